"""Speculative decoding is lossless: identical greedy (and seeded sampled) output, the target's
distribution under sampling (and a biased verifier is caught), strategies and the guard."""

import pytest
import torch
from scipy.stats import chisquare

import tailtamer.rollout.engine as engine_module
from tailtamer.errors import ConfigError
from tailtamer.model.drafter import init_drafter
from tailtamer.rollout.engine import Engine, EngineConfig
from tailtamer.rollout.suffix import SuffixProposer
from tailtamer.rollout.eagle import EagleProposer
from tailtamer.rollout.sampling import SamplingParams, target_probs
from tailtamer.rollout.speculative import Strategy, Tree, accept, ancestor_mask
from tailtamer.rollout.speculator import SpecConfig, Speculator
from conftest import TRAIN_PROMPTS, generate, random_model, token_prompts, tiny_config


@pytest.mark.parametrize("strategy", ["1_1_2", "4_1_5", "3_2_6", "4_3_10", "10_1_11@0.3", "6_2_8@0.2"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_is_identical_with_random_and_trained_drafters(target, trained_drafter, strategy, batch):
    params = SamplingParams(temperature=0, max_new_tokens=40, n=2)
    prompts = token_prompts(5)
    plain, _ = generate(target, prompts, params, batch)
    for proposer in (EagleProposer(init_drafter(target, std=0.2)), EagleProposer(trained_drafter), SuffixProposer()):
        spec, stats = generate(target, prompts, params, batch, proposer, strategy)
        assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
        assert [c.finish_reason for c in spec] == [c.finish_reason for c in plain]
        assert stats.sd_steps > 0


def test_requests_admitted_mid_speculation_catch_up_without_overflow(target):
    """A long prompt admitted while another request is near its end: the drafter catch-up pads
    the batch to the new prompt's length (regression: this overflowed the drafter cache)."""
    prompts = [[7] * 3, [8] * 40, [9] * 45, [10] * 50, [11] * 4]
    params = SamplingParams(temperature=0, max_new_tokens=200)
    config = EngineConfig(max_batch_size=2, max_seq_len=64)
    plain, _ = Engine(target, config=config, eos_ids=()).generate(prompts, params)
    spec, _ = Engine(target, config=config, eos_ids=(), speculator=Speculator.fixed(
        EagleProposer(init_drafter(target, std=0.2)), "3_2_6")).generate(prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]


def test_trained_drafter_accepts_more_than_random(target, trained_drafter):
    params = SamplingParams(temperature=0, max_new_tokens=40)
    prompts = TRAIN_PROMPTS[:6]  # a random target is only predictable where the drafter has seen it
    _, random_stats = generate(target, prompts, params, 6, EagleProposer(init_drafter(target, std=0.2)), "4_2_8")
    _, trained_stats = generate(target, prompts, params, 6, EagleProposer(trained_drafter), "4_2_8")
    assert trained_stats.accept_len_mean > random_stats.accept_len_mean + 0.3
    assert trained_stats.summary()["accept_rate_by_position"]["1"] > 0.3


@pytest.mark.parametrize("strategy", ["4_2_8", "10_1_11@0.3", "6_2_8@0.2"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, n=3, max_new_tokens=30, seed=5),
                                    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, n=3, max_new_tokens=30)])
def test_seeded_sampling_is_identical_in_float64(target, trained_drafter, params, strategy):
    """The token at response index t is drawn with the request's noise for index t, with or
    without SD, whatever the drafts."""
    prompts = TRAIN_PROMPTS[10:14]
    plain, _ = generate(target, prompts, params, 6)
    spec, stats = generate(target, prompts, params, 6, EagleProposer(trained_drafter), strategy)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert stats.accepted_tokens > 0


def test_float32_greedy_match_rate(trained_drafter):
    """float32: report (and bound) how often SD's greedy output equals plain greedy output."""
    target32 = random_model(tiny_config())  # the same weights as `target`, in float32
    drafter32 = init_drafter(target32)
    drafter32.load_state_dict({k: v.float() for k, v in trained_drafter.state_dict().items()})
    prompts = TRAIN_PROMPTS[:12]
    params = SamplingParams(temperature=0, max_new_tokens=40)
    plain, _ = generate(target32, prompts, params, 12)
    spec, _ = generate(target32, prompts, params, 12, EagleProposer(drafter32), "4_2_8")
    rate = sum(a.token_ids == b.token_ids for a, b in zip(plain, spec)) / len(plain)
    print(f"float32 greedy match rate: {rate:.2f}")
    assert rate >= 0.9


# --- distribution under sampling -------------------------------------------------------------

def _small_world():
    cfg = tiny_config(vocab_size=12, eos_token_id=None)
    model = random_model(cfg, seed=3, std=0.15).double()
    drafter = init_drafter(model, seed=1, std=0.3).double()
    return model, drafter


def _second_token_marginal(model, prompt, params):
    """p(x2) = sum_x1 p(x1) p(x2 | x1), with the same processing (temperature / top-k / top-p)."""
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([prompt]))[0][0, -1], params)
        seqs = torch.tensor([prompt + [x] for x in range(12)])
        p2 = target_probs(model(seqs)[0][:, -1], params)
    return p1 @ p2


def _lossy_accept(tree, draws):
    """A *biased* verifier: the drafter's top token is emitted unverified, then the target's
    draw after it."""
    B = tree.tokens.shape[0]
    path = torch.zeros(B, tree.depth + 1, dtype=torch.long)
    path[:, 1] = 1
    tokens = torch.stack([tree.tokens[:, 1], draws[:, 1]], 1)
    return path, torch.nn.functional.pad(tokens, (0, tree.depth - 1)), torch.full((B,), 2)


def _second_tokens(model, drafter, params, n):
    engine = Engine(model, config=EngineConfig(max_batch_size=256), eos_ids=(),
                    speculator=Speculator.fixed(EagleProposer(drafter), "2_3_5"))
    out, _ = engine.generate([[3, 7, 2]], SamplingParams(**{**params.__dict__, "n": n, "max_new_tokens": 3}))
    return torch.bincount(torch.tensor([c.token_ids[1] for c in out]), minlength=12)


@pytest.mark.parametrize("params", [SamplingParams(seed=21), SamplingParams(top_k=6, seed=22),
                                    SamplingParams(top_p=0.8, seed=23)], ids=["t1", "topk", "topp"])
def test_sd_samples_follow_the_target_distribution(params):
    model, drafter = _small_world()
    n = 3000
    counts = _second_tokens(model, drafter, params, n)
    expected = _second_token_marginal(model, [3, 7, 2], params) * n
    support = expected > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support].tolist(), expected[support].tolist()).pvalue > 1e-3


@pytest.mark.parametrize("strategy", ["3_3_8@0.3", "3_1_4@0.3"], ids=["tree", "chain"])
def test_confidence_shaped_drafts_sample_the_target_distribution(strategy):
    """The third token, which the first SD step's second-level drafts propose where the
    drafter was confident and the target alone decides where it was not (steps of both
    kinds ran): its distribution is the exact marginal."""
    model, _ = _small_world()
    drafter = init_drafter(model, seed=1, std=0.05).double()  # less sure of itself than _small_world's
    n, prompt, params = 3000, [3, 7, 2], SamplingParams(seed=24)
    engine = Engine(model, config=EngineConfig(max_batch_size=256), eos_ids=(),
                    speculator=Speculator.fixed(EagleProposer(drafter), strategy))
    out, stats = engine.generate([prompt], SamplingParams(seed=24, n=n, max_new_tokens=4))
    full = Strategy.parse(strategy).verify - 1
    request_steps = sum(stats.accept_lens.values())
    assert 0 < stats.drafted_tokens < full * request_steps  # some drafts were cut short, not all
    assert stats.accepted_tokens > 0
    counts = torch.bincount(torch.tensor([c.token_ids[2] for c in out]), minlength=12)
    with torch.no_grad():  # p(x3) = sum over x1, x2 of p(x1) p(x2 | x1) p(x3 | x1, x2)
        p1 = target_probs(model(torch.tensor([prompt]))[0][0, -1], params)
        p2 = target_probs(model(torch.tensor([prompt + [a] for a in range(12)]))[0][:, -1], params)
        p3 = target_probs(model(torch.tensor([prompt + [a, b] for a in range(12) for b in range(12)]))[0][:, -1],
                          params).view(12, 12, 12)
    expected = torch.einsum("a,ab,abc->c", p1, p2, p3) * n
    support = expected > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support].tolist(), expected[support].tolist()).pvalue > 1e-3


def test_the_same_check_rejects_a_biased_verifier(monkeypatch):
    model, drafter = _small_world()
    params = SamplingParams(seed=21)
    monkeypatch.setattr(engine_module, "accept", _lossy_accept)
    n = 3000
    counts = _second_tokens(model, drafter, params, n)
    expected = _second_token_marginal(model, [3, 7, 2], params) * n
    support = expected > 0
    assert chisquare(counts[support].tolist(), expected[support].tolist()).pvalue < 1e-3


# --- the pieces -------------------------------------------------------------------------------

def test_ancestor_mask():
    #   0 -> 1 -> 3
    #   0 -> 2 -> 4 -> 5, and padding node 6 (parent -1)
    parents = torch.tensor([[-1, 0, 0, 1, 2, 4, -1]])
    mask = ancestor_mask(parents, depth=3)[0].int().tolist()
    assert mask[3] == [1, 1, 0, 1, 0, 0, 0]
    assert mask[5] == [1, 0, 1, 0, 1, 1, 0]
    assert mask[6] == [0, 0, 0, 0, 0, 0, 1]


def test_accept_follows_the_draws_down_the_tree():
    # Request 0: root -> 7 (node 1) -> 8 (node 2); root -> 9 (node 3); draws 7, 8, 5 along it.
    # Request 1: the same tree, but the root draws 9: node 3 is taken, whose draw is 4.
    # Request 2: the root draws 6, no child: only the root. Node 4 of each is padding.
    tree = Tree(tokens=torch.tensor([[0, 7, 8, 9, 7]] * 3), parents=torch.tensor([[-1, 0, 1, 0, -1]] * 3),
                depths=torch.tensor([[0, 1, 2, 1, 1]] * 3),
                valid=torch.tensor([[True, True, True, True, False]] * 3), depth=2)
    draws = torch.tensor([[7, 8, 5, 1, 2], [9, 8, 5, 4, 2], [6, 8, 5, 4, 2]])
    path, tokens, length = accept(tree, draws)
    assert length.tolist() == [3, 2, 1]
    assert [p[:n] for p, n in zip(path.tolist(), length.tolist())] == [[0, 1, 2], [0, 3], [0]]
    assert [t[:n] for t, n in zip(tokens.tolist(), length.tolist())] == [[7, 8, 5], [9, 4], [6]]
    # a padding node is never reached, even when its token is drawn
    draws = torch.tensor([[7, 0, 0, 0, 0]] * 3)
    tree.tokens[:, 1] = 3
    assert accept(tree, draws)[2].tolist() == [1, 1, 1]
    # nor a node marked valid without a parent (its verify saw neither the root nor a path)
    tree.valid[:, 4] = True
    draws = torch.tensor([[7, 0, 0, 0, 0]] * 3)
    assert accept(tree, draws)[2].tolist() == [1, 1, 1]


def test_a_chain_accepts_what_the_tree_walk_accepts():
    """The chain fast path gives the general walk's path, tokens and length on chains of every
    depth, with draws that match the drafts for a random stretch and then at random."""
    from dataclasses import replace

    from tailtamer.rollout.eagle import chain_tree

    g = torch.Generator().manual_seed(0)
    for depth in (1, 2, 4, 7):
        tokens = torch.randint(0, 3, (64, depth + 1), generator=g)  # 3 symbols: many accepts
        draws = torch.randint(0, 3, (64, depth + 1), generator=g)
        agree = torch.rand(64, depth, generator=g) < 0.7
        draws[:, :-1] = torch.where(agree, tokens[:, 1:], draws[:, :-1])
        chain = chain_tree(tokens)
        fast, walk = accept(chain, draws), accept(replace(chain, chain=False), draws)
        for a, b in zip(fast, walk):
            assert torch.equal(a, b) and a.dtype == b.dtype
        assert set(fast[2].tolist()) == set(range(1, depth + 2))  # every length, 1 to depth + 1


@pytest.mark.parametrize("text,message", [("4_2", "DEPTH_TOPK_VERIFY"), ("a_b_c", "DEPTH_TOPK_VERIFY"),
                                          ("0_1_2", "depth >= 1"), ("4_1_1", "verify >= 2"),
                                          ("2_1_9", "a chain \\(top-k 1\\) verifies its 2 drafts and the pending token; write 2_1_3"),
                                          ("8_1_3", "verifies its 8 drafts and the pending token; write 8_1_9, or "
                                                    "2_1_3 for 2 drafts"),
                                          ("65_2_8", "depth at most 64"),
                                          ("64_64_258113", "at most 1024 tokens to verify a request, got 258113")])
def test_bad_strategies(text, message):
    with pytest.raises(ConfigError, match=message):
        Strategy.parse(text)


def test_a_tree_may_verify_every_candidate_its_beams_draft_and_no_more():
    # 3 levels of 2 beams: 2 children of the root, then 2 × 2 at each of the 2 levels below
    assert Strategy.parse("3_2_11").verify == 11
    with pytest.raises(ConfigError, match="11 draft tokens requested but depth 3 x top-k 2 yields only 10 candidates"):
        Strategy.parse("3_2_12")


@pytest.mark.parametrize("text,message", [("4_1_5@1", "in \\(0, 1\\)"), ("4_1_5@0", "in \\(0, 1\\)"),
                                          ("4_1_5@x", "a number in"), ("4_1_5@nan", "a number in"),
                                          ("4@0.3", "DEPTH_TOPK_VERIFY@CONFIDENCE")])
def test_bad_confidence_strategies(text, message):
    with pytest.raises(ConfigError, match=message):
        Strategy.parse(text)


def test_a_confidence_strategy_names_itself():
    s = Strategy.parse("12_1_13@0.30")
    assert (s.depth, s.topk, s.verify, s.confidence, s.name) == (12, 1, 13, 0.3, "12_1_13@0.3")
    assert Strategy.parse(s.name) == s and Strategy.parse("4_2_8").name == "4_2_8"
    close = Strategy.parse("4_1_5@0.1234567")
    assert Strategy.parse(close.name) == close != Strategy.parse("4_1_5@0.1234568")


def test_the_suffix_drafter_takes_only_its_own_arms():
    with pytest.raises(ConfigError, match="spec.strategies 7_1_8@0.3, 4_1_5\\+s4: the suffix drafter drafts sD_K_N"):
        SpecConfig(mode="adaptive", drafter="suffix", strategies=("s4_2_8", "7_1_8@0.3", "4_1_5+s4", "s2_1_3"))


def test_a_confidence_chain_is_not_compiled(target, trained_drafter):
    """Its stop is a decision in Python per level, which a compiled chain would not take: it
    runs eager, and stops."""
    proposer = EagleProposer(trained_drafter, compiled=True)
    propose, depths = proposer.propose, []
    proposer.propose = lambda *args: (lambda tree: (depths.append(tree.depth), tree)[1])(propose(*args))
    generate(target, TRAIN_PROMPTS[:2], SamplingParams(temperature=0, max_new_tokens=12), 2, proposer,
              "4_1_5@0.999999")
    assert depths and set(depths) == {1} and not proposer.chain.ready


@pytest.mark.parametrize("strategy", ["10_1_11", "6_2_8"])
def test_drafts_go_as_deep_as_the_drafter_is_confident(target, trained_drafter, strategy):
    """A floor no path reaches drafts one level; a floor every path clears drafts the full
    depth; a floor in between drafts some steps shallower than others."""
    depths = {}
    for floor in ("0.999999", "1e-30", "0.1"):
        proposer = EagleProposer(trained_drafter)
        propose, seen = proposer.propose, []

        def recording(*args, propose=propose, seen=seen):
            tree = propose(*args)
            seen.append(tree.depth)
            return tree

        proposer.propose = recording
        generate(target, TRAIN_PROMPTS[:3], SamplingParams(temperature=0, max_new_tokens=30), 3, proposer,
                  f"{strategy}@{floor}")
        depths[floor] = seen
    full = Strategy.parse(strategy).depth
    assert set(depths["0.999999"]) == {1} and set(depths["1e-30"]) == {full}
    assert min(depths["0.1"]) < max(depths["0.1"])


@pytest.mark.parametrize("kwargs,message", [
    ({"acceptance": "typical"}, "refused"), ({"acceptance": "threshold"}, "refused"),
    ({"acceptance": "whatever"}, "refused"), ({"mode": "on"}, "needs a drafter"),
    ({"mode": "maybe"}, "must be off, on or adaptive"), ({"mode": "on", "drafter": "suffix", "strategy": "9"}, "DEPTH_TOPK"),
    ({"mode": "on", "drafter": "suffix", "compile": True}, "spec.compile compiles an EAGLE drafter"),
    ({"mode": "on", "drafter": "suffix", "history": -1}, "spec.history must be >= 0"),
    ({"mode": "on", "drafter": "suffix", "history_tokens": 0}, "spec.history_tokens must be >= 1"),
    ({"mode": "on", "drafter": "suffix", "history_on_resume": "maybe"}, "spec.history_on_resume must be load or fresh"),
])
def test_lossless_guard_and_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SpecConfig(**kwargs)


def test_a_negative_threshold_is_refused():
    with pytest.raises(ConfigError, match="bs_threshold must be >= 0"):
        Speculator(SuffixProposer(), None, bs_threshold=-1)


def test_stats_count_drafts_and_acceptances(target, trained_drafter):
    _, stats = generate(target, token_prompts(3), SamplingParams(temperature=0, max_new_tokens=30), 3,
                         EagleProposer(trained_drafter), "3_2_6")
    s = stats.summary()
    steps = sum(s["accept_len_hist"].values())
    assert s["drafted_tokens"] == 5 * steps
    assert s["accepted_tokens"] == sum((int(k) - 1) * v for k, v in s["accept_len_hist"].items())
    rates = list(s["accept_rate_by_position"].values())
    assert rates == sorted(rates, reverse=True) and all(0 <= r <= 1 for r in rates)
