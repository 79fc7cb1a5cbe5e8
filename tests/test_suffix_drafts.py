"""Drafts from the suffix index, alone and fused with EAGLE's tree: lossless (greedy and seeded
output identical, the target's marginals under sampling), their sources counted, the history
kept across rollouts, bounded and saved; bad input refused in one line."""

import json

import pytest
import torch
from scipy.stats import chisquare

from tailtamer.errors import CheckpointError, ConfigError
from tailtamer.model.drafter import init_drafter
from tailtamer.rollout.draft_history import DraftHistory, prompt_key, save_histories
from tailtamer.rollout.eagle import EagleProposer, chain_tree
from tailtamer.rollout.engine import Engine, EngineConfig, Request
from tailtamer.rollout.fused import FusedProposer, fuse
from tailtamer.rollout.sampling import SamplingParams, target_probs
from tailtamer.rollout.speculative import Strategy
from tailtamer.rollout.speculator import SpecConfig, Speculator, make_speculator
from tailtamer.rollout.tuner import FixedTuner
from tailtamer.rollout.suffix import SuffixProposer, tree_of
from tailtamer.rollout.suffix_index import EAGLE, HISTORY, OWN, SIBLING
from conftest import random_model, tiny_config


def _prompts(n, seed=0, vocab=100):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (int(k),), generator=g).tolist() for k in torch.randint(1, 14, (n,), generator=g)]


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_config()).double()


def kept(history, prompt):
    return [list(r) for r in history.responses(prompt)]


def _proposers(target, kind, history=None):
    if kind == "suffix":
        return SuffixProposer(history)
    return FusedProposer(EagleProposer(init_drafter(target, std=0.2)), SuffixProposer(history))


def _run(target, prompts, params, batch, proposer=None, strategy=None):
    speculator = Speculator.fixed(proposer, strategy) if proposer is not None else None
    return Engine(target, config=EngineConfig(max_batch_size=batch), speculator=speculator).generate(prompts, params)


@pytest.mark.parametrize("strategy", ["s6_2_9", "s4_1_5", "s8_3_12@0.2", "4_1_5+s6", "3_2_6+s8", "6_2_8@0.2+s4"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_is_identical_and_the_index_drafts(target, strategy, batch):
    # a group split by the batch's edge: its last sibling starts once the others are done
    params = SamplingParams(temperature=0, max_new_tokens=48, n={1: 3, 3: 4, 8: 3}[batch])
    prompts = _prompts(4)
    plain, _ = _run(target, prompts, params, batch)
    kind = "suffix" if strategy.startswith("s") else "fused"
    out, stats = _run(target, prompts, params, batch, _proposers(target, kind), strategy)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    by_source = stats.summary()["by_source"]
    # greedy siblings are equal: one admitted after another finished drafts it all
    assert by_source["own"]["accepted"] + by_source.get("siblings", {"accepted": 0})["accepted"] > 0, by_source
    assert (kind == "fused") == ("eagle" in by_source)


@pytest.mark.parametrize("strategy", ["s6_2_9", "4_2_8+s6"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, n=4, max_new_tokens=40, seed=5),
                                    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, n=4, max_new_tokens=40)])
def test_seeded_sampling_is_identical(target, strategy, params):
    prompts = _prompts(3, seed=4)
    plain, _ = _run(target, prompts, params, 5)
    out, stats = _run(target, prompts, params, 5, _proposers(target, "suffix" if strategy[0] == "s" else "fused"),
                      strategy)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    assert stats.sd_steps > 0


def _marginals(model, prompt, params):
    """p(x2) and p(x3) after `prompt`, with the same processing (temperature / top-k / top-p)."""
    V = model.config.vocab_size
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([prompt]))[0][0, -1], params)
        p2 = target_probs(model(torch.tensor([prompt + [a] for a in range(V)]))[0][:, -1], params)
        p3 = target_probs(model(torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)]))[0][:, -1],
                          params).view(V, V, V)
    return p1 @ p2, torch.einsum("a,ab,abc->c", p1, p2, p3)


@pytest.mark.parametrize("strategy", ["s3_2_6", "2_2_5+s4"], ids=["suffix", "fused"])
def test_suffix_and_fused_drafts_sample_the_target_distribution(strategy):
    """3,000 siblings of one prompt, 256 at a time: later ones draft their second and third
    tokens from the finished ones' text (deterministic drafts, EAGLE's beside them in the
    fused tree). Both tokens' distributions are the exact marginals. (The same check catches a
    biased verifier: tests/test_speculative.py.)"""
    cfg = tiny_config(vocab_size=12, eos_token_id=None)
    model = random_model(cfg, seed=3, std=0.15).double()
    proposer = SuffixProposer() if strategy[0] == "s" else FusedProposer(
        EagleProposer(init_drafter(model, seed=1, std=0.3).double()), SuffixProposer())
    n, prompt, params = 3000, [3, 7, 2], SamplingParams(seed=25)
    engine = Engine(model, config=EngineConfig(max_batch_size=256), eos_ids=(),
                    speculator=Speculator.fixed(proposer, strategy))
    out, stats = engine.generate([prompt], SamplingParams(seed=25, n=n, max_new_tokens=4))
    assert stats.accepted_by_source.get("siblings", 0) > 300  # the index's drafts are verified, and some taken
    for position, expected in zip((1, 2), _marginals(model, prompt, params)):
        counts = torch.bincount(torch.tensor([c.token_ids[position] for c in out]), minlength=12)
        expected = expected * n
        support = expected > 0
        assert counts[~support].sum() == 0
        assert chisquare(counts[support].tolist(), expected[support].tolist()).pvalue > 1e-3


class Alternating(FixedTuner):
    """A model-free arm and a drafter arm, turn about."""

    def __init__(self, *names):
        self.strategies = [Strategy.parse(n) for n in names]
        self.turn = 0

    def select(self, batch_size):
        self.turn += 1
        return self.strategies[self.turn % len(self.strategies)]


def test_a_drafter_arm_after_model_free_drafts_catches_up_first(target, monkeypatch):
    """The drafter does not run in a suffix-only step, so the next EAGLE step starts behind; it
    catches up first, charged to no arm, as after plain steps; output as plain decoding's."""
    proposer = _proposers(target, "fused")
    arms = []
    catch_up = proposer.catch_up
    monkeypatch.setattr(proposer, "catch_up", lambda running: arms.append("catch-up") or catch_up(running))
    propose = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda *a: arms.append(a[2].name) or propose(*a))
    engine = Engine(target, config=EngineConfig(max_batch_size=4), speculator=Speculator(proposer, Alternating(
        "s4_1_5", "3_1_4")))
    params = SamplingParams(temperature=0, max_new_tokens=30)
    prompts = _prompts(4, seed=3)
    out, _ = engine.generate(prompts, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in _run(target, prompts, params, 4)[0]]
    assert arms[:6] == ["catch-up", "3_1_4", "s4_1_5", "catch-up", "3_1_4", "s4_1_5"]
    assert all(b == "catch-up" for a, b in zip(arms, arms[1:]) if a == "s4_1_5")


def test_fuse_shares_what_both_propose_and_appends_the_rest():
    # EAGLE's chain: root 9 -> 1 -> 2. The index proposes 1 -> 2 -> 3 (shared, shared, new) and 5 (new).
    tree = chain_tree(torch.tensor([[9, 1, 2]]))
    nodes = [[(1, -1, 1, 0.9, SIBLING), (5, -1, 1, 0.1, OWN), (2, 0, 2, 0.8, SIBLING), (3, 2, 3, 0.7, HISTORY)]]
    fused = fuse(tree, nodes)
    assert fused.tokens[0].tolist() == [9, 1, 2, 5, 3]
    assert fused.parents[0].tolist() == [-1, 0, 1, 0, 2]
    assert fused.depths[0].tolist() == [0, 1, 2, 1, 3] and fused.depth == 3 and not fused.chain
    assert fused.valid[0].tolist() == [True] * 5
    assert fused.sources[0].tolist() == [0, EAGLE, EAGLE, OWN, HISTORY]
    # two requests: the second's tree is smaller, so it is padded with nodes no walk reaches
    two = fuse(chain_tree(torch.tensor([[9, 1, 2], [4, 4, 4]])), [nodes[0], []])
    assert two.tokens.shape == (2, 5) and two.valid[1].tolist() == [True] * 3 + [False] * 2
    assert two.parents[1].tolist() == [-1, 0, 1, -1, -1]


def test_a_suffix_branch_that_extends_the_chain_is_verified_as_a_chain():
    tree = chain_tree(torch.tensor([[9, 1, 2], [8, 3, 3]]))
    nodes = [[(1, -1, 1, 0.9, SIBLING), (2, 0, 2, 0.9, SIBLING), (7, 1, 3, 0.9, SIBLING)],
             [(3, -1, 1, 0.5, OWN), (3, 0, 2, 0.5, OWN), (6, 1, 3, 0.5, OWN)]]
    fused = fuse(tree, nodes)
    assert fused.chain and fused.depth == 3
    assert fused.tokens.tolist() == [[9, 1, 2, 7], [8, 3, 3, 6]]
    assert fused.sources.tolist() == [[0, EAGLE, EAGLE, SIBLING], [0, EAGLE, EAGLE, OWN]]


def test_a_suffix_tree_is_as_wide_as_its_drafts_and_a_chain_where_every_request_drafts_one():
    chains = tree_of([5, 6], [[(1, -1, 1, 1.0, OWN), (2, 0, 2, 0.5, OWN)],
                              [(3, -1, 1, 1.0, SIBLING), (4, 0, 2, 1.0, HISTORY)]], "cpu")
    assert chains.chain and chains.depth == 2 and chains.tokens.tolist() == [[5, 1, 2], [6, 3, 4]]
    assert chains.sources.tolist() == [[0, OWN, OWN], [0, SIBLING, HISTORY]]
    few = tree_of([5, 6], [[(1, -1, 1, 0.6, OWN), (2, -1, 1, 0.4, OWN)], []], "cpu")  # budget 9, 2 drafts
    assert not few.chain and few.tokens.shape == (2, 3) and few.valid.tolist() == [[True] * 3, [True, False, False]]
    none = tree_of([5, 6], [[], []], "cpu")  # nothing drafted: the step verifies the pending tokens alone
    assert none.chain and none.tokens.tolist() == [[5], [6]] and none.depth == 0


def test_a_tree_node_with_a_source_counts_where_its_accepted_drafts_came_from():
    from tailtamer.rollout.stats import RolloutStats

    stats = RolloutStats()
    stats.record_sd(4, 5, [SIBLING, SIBLING, EAGLE], running=3)
    stats.record_sd(2, 5, None, running=1)
    stats.record_drafted_sources([0, 2, 0, 3, 0], [5])
    summary = stats.summary()
    assert summary["by_source"] == {"eagle": {"drafted": 2, "accepted": 2}, "siblings": {"drafted": 3, "accepted": 2}}
    assert summary["accepted_by_batch_size"] == {"2-3": {"siblings": 2.0, "eagle": 1.0}, "1": {"eagle": 1.0}}


@pytest.mark.parametrize("text,fields", [("s8_2_9", (8, 2, 9, 0.0, 0, True)), ("s4_1_5@0.2", (4, 1, 5, 0.2, 0, True)),
                                         ("4_1_5+s8", (4, 1, 5, 0.0, 8, False)),
                                         ("7_1_8@0.3+s4", (7, 1, 8, 0.3, 4, False))])
def test_suffix_strategies_parse_and_name_themselves(text, fields):
    s = Strategy.parse(text)
    assert (s.depth, s.topk, s.verify, s.confidence, s.suffix, s.model_free) == fields
    assert s.name == text and Strategy.parse(s.name) == s
    assert s.width == s.verify + s.suffix


@pytest.mark.parametrize("text,message", [("s4_1_9", "write s4_1_5"), ("4_1_5+s", "not DEPTH_TOPK_VERIFY"),
                                          ("4_1_5+s0x", "not DEPTH_TOPK_VERIFY"),
                                          ("s4_2_8+s3", "s4_2_8 is the suffix drafter's arm already$"),
                                          ("4_1_5+s99", "adds 1 to 64"), ("x4_1_5", "not DEPTH_TOPK_VERIFY"),
                                          ("4_1_5@0.3+s0", "write 4_1_5@0.3 for the EAGLE tree alone"),
                                          ("s4_1_5+s0", "s4_1_5 is the suffix drafter's arm already$"),
                                          ("s4_2_32", "31 draft tokens requested but a suffix tree of depth 4 and "
                                                      "top-k 2 holds at most 30 candidates"),
                                          ("s4_2_100000", "at most 1024 tokens to verify a request, got 100000")])
def test_bad_suffix_strategies(text, message):
    with pytest.raises(ConfigError, match=message):
        Strategy.parse(text)


def test_a_suffix_arm_may_verify_every_draft_its_trie_holds_and_no_more():
    """Unchecked, s4_2_100000 ran 26x slower than s8_2_9 with the same output: its budget went
    into every request's cache rows."""
    assert Strategy.parse("s4_2_31").verify == 31  # 2 + 4 + 8 + 16 drafts and the pending token
    assert Strategy.parse("s3_1_4").verify == 4


def test_the_speculator_pays_for_the_index_only_where_an_arm_uses_it(target, tmp_path):
    from tailtamer.model.drafter import save_drafter

    save_drafter(init_drafter(target), tmp_path / "d")
    eagle = make_speculator(SpecConfig(mode="adaptive", drafter=str(tmp_path / "d")), target)
    fused = make_speculator(SpecConfig(mode="adaptive", drafter=str(tmp_path / "d"),
                                       strategies=("4_2_8+s8", "4_1_5+s4", "s4_1_5")), target)
    alone = make_speculator(SpecConfig(mode="on", drafter="suffix"), target)
    assert type(eagle.proposer) is EagleProposer and type(fused.proposer) is FusedProposer
    assert type(alone.proposer) is SuffixProposer and alone.tuner.strategy.name == "s8_2_9"
    assert fused.proposer.suffix.history is None  # one rollout: nothing earlier to draft from
    assert SpecConfig(mode="on", drafter="d", strategy="4_1_5+s4").make_history(100, None).per_prompt == 8
    assert SpecConfig(mode="adaptive", drafter="d").make_history(100, None) is None  # no arm reads it
    assert SpecConfig(mode="on", drafter="suffix", history=0).make_history(100, None) is None
    with pytest.raises(ConfigError, match="spec.drafter=ngram is vLLM's prompt lookup"):
        make_speculator(SpecConfig(mode="on", drafter="ngram"), target)


@pytest.mark.parametrize("spec", [
    SpecConfig(mode="on", drafter="/no/drafter", strategy="2_200_3"),
    SpecConfig(mode="adaptive", drafter="/no/drafter", strategies=("4_1_5", "2_200_3+s4"))])
def test_a_top_k_above_the_vocabulary_is_refused_before_the_drafter_loads(target, spec):
    field = "spec.strategy 2_200_3" if spec.mode == "on" else "spec.strategies 2_200_3\\+s4"
    with pytest.raises(ConfigError, match=f"^{field}: a top-k above the model's {target.config.vocab_size} tokens"):
        make_speculator(spec, target)


def test_a_history_cap_past_the_machines_memory_is_refused():
    SpecConfig(mode="on", drafter="suffix", history_tokens=1 << 29).make_history(100, 8 << 30)  # 2 GiB of 8: kept
    with pytest.raises(ConfigError, match=r"spec.history_tokens=2147483648 would hold 8.0 GiB of responses, over "
                                          r"half of what it may use \(this machine has 8.0 GiB available\): lower "
                                          r"spec.history_tokens"):
        SpecConfig(mode="on", drafter="suffix", history_tokens=1 << 31).make_history(100, 8 << 30)
    with pytest.raises(ConfigError, match=r"8.0 GiB of responses, over half of what it may use \(each of the 2 "
                                          r"workers on this machine has 8.0 GiB of the machine's available memory and "
                                          r"keeps a history of its own\): lower"):
        SpecConfig(mode="on", drafter="suffix", history_tokens=1 << 31).make_history(100, 8 << 30, 2)


def test_group_size_one_drafts_from_its_own_text(target):
    params = SamplingParams(temperature=0, max_new_tokens=60)
    prompts = _prompts(3, seed=7)
    plain, _ = _run(target, prompts, params, 3)
    out, stats = _run(target, prompts, params, 3, SuffixProposer(), "s6_2_9")
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    assert set(stats.accepted_by_source) == {"own"}


def test_later_rollouts_draft_from_earlier_responses_to_the_same_prompt(target):
    """The same prompts again (a later epoch): sampled afresh, drafted from the history too;
    output identical to plain decoding with the same seeds."""
    history = DraftHistory(per_prompt=4, max_tokens=10_000, vocab_size=target.config.vocab_size)
    engine = Engine(target, config=EngineConfig(max_batch_size=16),
                    speculator=Speculator.fixed(SuffixProposer(history), "s6_2_9"))
    prompts = _prompts(4, seed=11)
    first = SamplingParams(temperature=0, max_new_tokens=40, n=2)
    engine.generate(prompts, first)
    assert all(len(kept(history, p)) == 2 for p in prompts)
    again = SamplingParams(temperature=0, max_new_tokens=40, n=1)
    out, stats = engine.generate(prompts, again)
    plain, _ = _run(target, prompts, again, 16)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    assert stats.accepted_by_source.get("history", 0) > 0


def test_a_group_drafts_from_the_earlier_responses_its_finished_siblings_pushed_out():
    """A sibling that finishes before its group's index is built enters the history (kept with
    the checkpoint) but is indexed once, as a member; the earlier rollout's response it pushed
    out of a one-response history is still drafted from in this rollout."""
    history = DraftHistory(per_prompt=1, max_tokens=100, vocab_size=50)
    history.add([1, 2], [10, 11, 12])
    proposer = SuffixProposer(history)
    done, running = (Request(0, i, [1, 2], key=i, max_new_tokens=8) for i in range(2))
    proposer.admit([done, running])
    done.output_ids, running.output_ids = [20, 21, 22, 3], [10, 11]
    proposer.retire([done])
    assert kept(history, [1, 2]) == [[20, 21, 22, 3]]
    [nodes] = proposer.drafts([running], depth=4, size=4, topk=1, floor=0.0)
    assert [(token, source) for token, _, _, _, source in nodes] == [(12, HISTORY)]
    index = proposer.groups[0].index
    state, matched = index.match(index.add_text([20, 21]))
    assert matched == 2 and index.followers(state) == {22: 1}  # the finished sibling, once


def test_the_history_keeps_the_last_responses_per_prompt_and_a_token_cap():
    h = DraftHistory(per_prompt=2, max_tokens=10, vocab_size=50)
    h.add([1, 2], [3, 4, 5])
    h.add([1, 2], [6])
    h.add([1, 2], [7, 8])  # the oldest of [1, 2]'s three goes
    assert kept(h, [1, 2]) == [[6], [7, 8]] and h.tokens == 3
    h.add([9], [1] * 6)
    h.add([10], [2] * 3)  # 12 tokens: the prompt answered longest ago ([1, 2]) loses its responses, oldest first
    assert kept(h, [1, 2]) == [] and h.tokens == 9 and list(h.prompts) == [prompt_key([9]), prompt_key([10])]
    assert kept(h, [10]) == [[2, 2, 2]]
    assert kept(DraftHistory(per_prompt=0, max_tokens=10, vocab_size=50), [1]) == []


def test_the_history_file_round_trips_per_worker(tmp_path):
    a, b = (DraftHistory(4, 100, vocab_size=50) for _ in range(2))
    a.add([1], [2, 3])
    b.add([4], [5])
    save_histories(tmp_path / "h.json", [a.entries(), b.entries()], 50)
    same_world = DraftHistory(4, 100, vocab_size=50)
    same_world.load(tmp_path / "h.json", rank=1, world=2)
    assert same_world.entries() == b.entries()
    other_world = DraftHistory(4, 100, vocab_size=50)
    other_world.load(tmp_path / "h.json", rank=0, world=1)  # another number of workers: all of it
    assert kept(other_world, [1]) == [[2, 3]] and kept(other_world, [4]) == [[5]]


@pytest.mark.parametrize("content,reason", [
    ("{not json", "JSONDecodeError"),
    ("[" * 100_000 + "]" * 100_000, "RecursionError"),
    (json.dumps({"format": "tailtamer draft history", "version": 1, "vocab_size": 60, "workers": []}),
     "made for a vocabulary of 60 tokens, this model has 50"),
    (json.dumps({"format": "tailtamer draft history", "version": 1, "vocab_size": "50", "workers": []}),
     "vocab_size '50' is not a number of tokens"),
    (json.dumps({"format": "tailtamer draft history", "version": 2, "vocab_size": 50, "workers": []}),
     "version 2, this tailtamer reads version 1"),
    (json.dumps({"format": "tailtamer draft history", "version": 1, "vocab_size": 50,
                 "workers": [[["k" * 32, [[1, 99]]]]]}),
     "is not a prompt key and lists of token ids below 50"),
    (json.dumps({"format": "other"}), "not a draft history"),
])
def test_a_bad_history_file_is_one_line_naming_it(tmp_path, content, reason):
    path = tmp_path / "draft_history.json"
    path.write_text(content)
    h = DraftHistory(4, 100, vocab_size=50)
    h.add([1], [2])
    with pytest.raises(CheckpointError) as e:
        h.load(path)
    message = str(e.value)
    assert message.startswith(f"{path}: cannot read the draft history") and reason in message
    assert "spec.history_on_resume=fresh" in message and "\n" not in message
    assert kept(h, [1]) == [[2]]  # nothing lost


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_p=0.9, n=3, max_new_tokens=30, seed=8,
                                                   logprobs=True),
                                    SamplingParams(temperature=0, n=2, max_new_tokens=30, logprobs=True)])
def test_each_tokens_log_probability_is_recorded_as_drawn_with_or_without_sd(target, params):
    """The log-probability of every emitted token under the distribution it was drawn from
    (greedy: the temperature-1 one): the same with SD (chain, tree, suffix, fused) as without,
    and equal to a recomputation over the finished sequence."""
    prompts = _prompts(3, seed=12)
    plain, _ = _run(target, prompts, params, 4)
    eagle = EagleProposer(init_drafter(target, std=0.2))
    for proposer, strategy in ((eagle, "4_1_5"), (eagle, "4_2_8"), (SuffixProposer(), "s6_2_9"),
                               (_proposers(target, "fused"), "4_1_5+s6")):
        out, _ = _run(target, prompts, params, 4, proposer, strategy)
        assert [c.token_ids for c in out] == [c.token_ids for c in plain]
        for a, b in zip(out, plain):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-9)
    processed = params if not params.greedy else SamplingParams(temperature=1.0)
    for c in plain:
        p = prompts[c.prompt_index]
        assert len(c.logprobs) == len(c.token_ids)
        with torch.no_grad():
            logits = target(torch.tensor([p + c.token_ids]))[0][0, len(p) - 1: -1]
        expected = target_probs(logits, processed).gather(1, torch.tensor(c.token_ids)[:, None]).log().squeeze(1)
        assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), expected, atol=1e-9)
    assert plain[0].logprobs is not None and _run(target, prompts[:1], SamplingParams(max_new_tokens=3), 1)[0][0].logprobs is None
