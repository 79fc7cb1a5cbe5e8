"""The EAGLE proposer's draft chains and what it observes: compiled chains against eager ones,
a chain against one decode call per level and against the drafter run without a cache; the
pairs the prefill, a slot's new request and a finished request hand it, and the rows siblings
share at the switch."""

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

import tailtamer.rollout.engine as engine_module
from tailtamer.model.draft_step import chain_index
from tailtamer.model.drafter import init_drafter
from tailtamer.rollout.engine import Engine, EngineConfig
from tailtamer.rollout.eagle import EagleProposer
from tailtamer.rollout.sampling import SamplingParams
from tailtamer.rollout.speculative import Strategy
from tailtamer.rollout.speculator import Speculator
from conftest import TRAIN_PROMPTS, generate, random_model, token_prompts, tiny_config


def _check_compiled(proposer):
    """Skip where torch.compile cannot build code (no C++ compiler: Inductor uses $CXX, else
    g++); anywhere else the chain must have compiled. (Skipping on any error that names a
    compiler hid a real failure: Inductor's errors all say `BackendCompilerFailed`.)"""
    if proposer.chain.error is not None and not shutil.which(os.environ.get("CXX") or "g++"):
        pytest.skip(f"no C++ compiler for torch.compile here: {proposer.chain.error}")
    assert proposer.chain.error is None


@pytest.mark.slow  # compiles three graphs
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_draft_chains_draft_what_eager_chains_draft(target, trained_drafter, temperature):
    """The compiled chain (extend and levels in one graph, batches padded to a bucket) drafts
    the eager chain's tokens, top-1 or coupled (T = 1): the same output and the same accepts,
    step for step. Batches of 4 to 1 running, so bucket 4 pads 3 requests; prompts past the
    batch, so admissions and compaction happen between chains."""
    params = SamplingParams(temperature=temperature, max_new_tokens=30, seed=4)
    prompts = TRAIN_PROMPTS[:7]
    eager, eager_stats = generate(target, prompts, params, 4, EagleProposer(trained_drafter), "3_1_4")
    proposer = EagleProposer(trained_drafter, compiled=True)
    calls = []
    compiled_fn = proposer.chain.fn
    proposer.chain.fn = lambda *a, **kw: calls.append(a[3].shape[0]) or compiled_fn(*a, **kw)
    spec, stats = generate(target, prompts, params, 4, proposer, "3_1_4")
    _check_compiled(proposer)
    assert proposer.chain.ready == {(1, 3), (2, 3), (4, 3)}
    # every SD step ran compiled, 3 running among them; compiling was charged to no step
    assert len(calls) == stats.sd_steps and 3 in stats.seconds_by_running
    assert stats.setup_s == proposer.setup_s > 0 and proposer.notice.startswith("spec.compile: draft chains compiled")
    assert [c.token_ids for c in spec] == [c.token_ids for c in eager]
    # (sampled, this random target's draws spread: a few drafts are accepted)
    assert stats.accept_lens == eager_stats.accept_lens and stats.accept_len_mean > (1.2 if temperature == 0 else 1.0)


@pytest.mark.slow  # compiles a graph (or reuses the test above's)
def test_a_compiled_chain_drafts_and_writes_what_the_eager_chain_does(target, trained_drafter):
    """One SD step's chains from the same state: the same drafts, and the same drafter cache
    rows wherever a later step reads (below each request's last level)."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(3, 20, target.config.hidden_size, generator=g, dtype=torch.float64)
    tokens = torch.randint(5, 100, (3, 20), generator=g)
    running = [SimpleNamespace(slot=i, cached=c, prompt_index=i) for i, c in enumerate((12, 9, 15))]
    strategy = Strategy.parse("3_1_4")
    out = []
    with torch.inference_mode():
        for compiled in (False, True):
            proposer = EagleProposer(trained_drafter, compiled=compiled)
            proposer.reserve(4, 32)
            proposer.observe(slice(0, 3), torch.arange(20).expand(3, 20), features, tokens)
            proposer.catch_up(running)
            proposer.drafted[:3] = [c - k for c, k in zip((12, 9, 15), (1, 4, 2))]  # backlogs of 1, 4 and 2 pairs
            tree = proposer.propose(running, torch.tensor([12, 9, 15]), strategy)
            out.append((tree.tokens, [proposer.cache.kv[0, r.slot, :, : r.cached + 2] for r in running]))
    _check_compiled(proposer)
    assert proposer.chain.ready == {(4, 3)}  # 3 running, padded to 4
    (eager_tokens, eager_rows), (tokens, rows) = out
    assert torch.equal(tokens, eager_tokens)
    for a, b in zip(rows, eager_rows):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("consecutive", [False, True])
def test_a_draft_chain_drafts_and_writes_what_one_decode_call_per_level_does(consecutive):
    """`Drafter.draft_chain` builds the extend's and every level's inputs at once, over a
    right-padded backlog: its drafts and every drafter cache row a later step reads must be
    those of each request alone, its exact backlog in one `decode` call, then one call per
    level at row `cached + d - 1`. Slots out of order and backlogs of 1, 4 and 2 pairs, so
    the padding rows overlap the levels' rows (a random float64 drafter, whose top tokens and
    rows show any row read or written wrong). `consecutive`: one request, its rows given by
    `first` and taken by slicing. Rows past the backlog hold stale keys, which no call may
    read."""
    target = random_model(tiny_config()).double()
    drafter = init_drafter(target, std=0.5)
    depth, g = 4, torch.Generator().manual_seed(4)
    features = torch.randn(3, 20, target.config.hidden_size, generator=g, dtype=torch.float64)
    tokens = torch.randint(5, 100, (3, 20), generator=g)
    slot_ids, cached, backlogs = ([2], [12], [3]) if consecutive else ([3, 0, 2], [12, 9, 15], [1, 4, 2])
    firsts = [c - k for c, k in zip(cached, backlogs)]
    with torch.inference_mode():
        cache, alone = drafter.new_cache(4, 40), drafter.new_cache(4, 40)
        expected = []
        for b, (s, f, e) in enumerate(zip(slot_ids, firsts, cached)):
            for c in (cache, alone):  # the rows before the backlog
                drafter.decode(tokens[b:b + 1, :f], features[b:b + 1, :f], c, slice(s, s + 1), torch.tensor([0]))
            # stale keys (random, larger than real ones: some outscore them in every head)
            cache.kv[:, s, :, f:] = torch.randn(cache.kv[:, s, :, f:].shape, generator=g, dtype=torch.float64) \
                * 10 * cache.kv[:, s, :, :f].abs().mean()
            logits, h = drafter.decode(tokens[b:b + 1, f:e], features[b:b + 1, f:e], alone, slice(s, s + 1),
                                       torch.tensor([f]), last=torch.tensor([e - f - 1]))
            drafts = [int(logits[0].argmax())]
            for d in range(1, depth):
                logits, h = drafter.decode(torch.tensor([[drafts[-1]]]), h[:, None] if h.dim() == 2 else h, alone,
                                           slice(s, s + 1), torch.tensor([e + d - 1]))
                drafts.append(int(logits[0, -1].argmax()))
            expected.append(drafts)
        width = max(backlogs)
        index = (torch.tensor(firsts)[:, None] + torch.arange(width)).clamp(max=19)
        rows = torch.arange(len(slot_ids))[:, None]
        span = max(max(firsts) + width, max(cached) + depth - 1)
        if consecutive:
            got = drafter.draft_chain(cache.kv[0], cache, slice(2, 3), tokens[rows, index], features[rows, index],
                                       None, None, depth, span, first=firsts[0])
        else:
            got = drafter.draft_chain(cache.kv[0], cache, torch.tensor(slot_ids), tokens[rows, index],
                                       features[rows, index], chain_index(firsts, cached, width, depth, "cpu"),
                                       torch.tensor(backlogs) - 1, depth, span)
    assert got.tolist() == expected
    for s, c in zip(slot_ids, cached):  # the committed rows and the levels' rows
        torch.testing.assert_close(cache.kv[:, s, :, : c + depth - 1], alone.kv[:, s, :, : c + depth - 1])


@pytest.mark.parametrize("std", [0.2, 0.5])
def test_an_eager_chain_drafts_what_the_drafter_drafts_without_a_cache(target, std):
    """Each level of a chain (its rows, positions, masks and rotations built for all levels at
    once) drafts the top token of the drafter's training pass, no cache, over the request's
    pairs followed by the levels before it: (ĥ, draft) pairs at the next positions. Requests
    of different lengths and backlogs, so each row's levels sit at its own positions; their
    pairs come from a prefill, plain steps (which the proposer queues) and, each request's
    last pair, an SD step that accepted nothing (queued too: one pair per request), and
    requests move to lower slots as the engine compacts the batch, one before the catch-up
    with pairs still queued and one after, with its drafter rows. Random drafters: a trained
    one's top token barely depends on what it attends to."""
    drafter = init_drafter(target, std=std)
    g = torch.Generator().manual_seed(2)
    features = torch.randn(5, 20, target.config.hidden_size, generator=g, dtype=torch.float64)
    tokens = torch.randint(5, 100, (5, 20), generator=g)
    requests = [SimpleNamespace(slot=i, cached=c, prompt_index=i) for i, c in enumerate((14, 7, 18, 12, 10))]
    r0, r1, r2, r3, r4 = requests
    last = torch.tensor([r.cached - 1 for r in requests])

    def plain(p, rows):  # one plain step's pairs of the requests in slots 0, 1, ...; zeros for a last pair
        seen = p < last[rows, None]
        proposer.observe(slice(0, len(rows)), torch.full((len(rows), 1), p), features[rows, p:p + 1] * seen[..., None],
                         tokens[rows, p:p + 1] * seen)

    def move(r, slot):  # compaction: r takes the slot of a request that finished
        proposer.move_slot(r.slot, slot, r.cached)
        r.slot = slot

    with torch.inference_mode():
        proposer = EagleProposer(drafter)
        proposer.reserve(5, 32)
        proposer.observe(slice(0, 5), torch.arange(6).expand(5, 6), features[:, :6], tokens[:, :6])  # a prefill
        for p in range(6, 10):
            plain(p, [0, 1, 2, 3, 4])
        move(r4, 1)  # r1 finished
        for p in range(10, 20):
            plain(p, [0, 4, 2, 3])
        proposer.catch_up([r0, r4, r2, r3])
        move(r3, 0)  # r0 finished
        running = [r3, r4, r2]
        rows = last[[3, 4, 2]]
        proposer.observe(slice(0, 3), rows[:, None], features[[3, 4, 2], rows][:, None], tokens[[3, 4, 2], rows][:, None])
        cached = [r.cached for r in running]
        proposer.drafted[:3] = [c - k for c, k in zip(cached, (1, 3, 2))]
        drafts = proposer.propose(running, torch.tensor(cached), Strategy.parse("4_1_5")).tokens[:, 1:]
        for i, (row, c) in enumerate(zip((3, 4, 2), cached)):
            ids, hidden = tokens[row, :c], features[row, :c]
            expected = []
            for _ in range(4):
                logits, out = drafter(ids[None], hidden[None])
                expected.append(int(logits[0, -1].argmax()))
                ids, hidden = torch.cat((ids, torch.tensor(expected[-1:]))), torch.cat((hidden, out[0, -1:]))
            assert drafts[i].tolist() == expected


def test_siblings_share_their_prompts_drafter_rows_at_the_switch(target, trained_drafter, monkeypatch):
    """Siblings fresh from one prefill hold the same pairs over their prompt: the catch-up runs
    the drafter over the first one's backlog only and copies its rows to the others up to where
    their pairs part, and every slot ends with the rows the drafter computes for it alone."""
    g = torch.Generator().manual_seed(1)
    features = torch.randn(4, 16, target.config.hidden_size, generator=g, dtype=torch.float64)
    tokens = torch.randint(5, 100, (4, 16), generator=g)
    features[1:3, :9], tokens[1:3, :9] = features[0, :9], tokens[0, :9]  # prompt 0's 9 pairs
    features[1, 4] += 1.0  # slot 1's pairs part from slot 0's at pair 4
    cached = (10, 10, 14, 12)  # slot 2 took plain steps after its prefill; slot 3 is another prompt
    rows, widths = [], []
    decode = trained_drafter.decode
    monkeypatch.setattr(trained_drafter, "decode", lambda ids, *a, **k: calls.append(tuple(ids.shape)) or
                        decode(ids, *a, **k))
    with torch.inference_mode():
        for prompts in ((0, 0, 0, 1), (0, 1, 2, 3)):  # siblings, and every slot on its own
            proposer = EagleProposer(trained_drafter)
            proposer.reserve(4, 32)
            proposer.observe(slice(0, 4), torch.arange(16).expand(4, 16), features, tokens)
            calls = []
            running = [SimpleNamespace(slot=i, cached=c, prompt_index=p) for i, (c, p) in enumerate(zip(cached, prompts))]
            assert proposer.catch_up(running)
            assert proposer.drafted[:4] == [c - 1 for c in cached]
            rows.append([proposer.cache.kv[:, r.slot, :, : r.cached - 1].clone() for r in running])
            widths.append(calls)
    # shared: slot 0 alone (9 pairs), then slot 1 from pair 4, slot 2 from pair 9 and slot 3
    assert widths == [[(1, 9), (3, 11)], [(4, 13)]]
    for shared, alone in zip(*rows):
        torch.testing.assert_close(shared, alone)


def test_a_chain_that_fails_to_compile_runs_eager(target, trained_drafter):
    params = SamplingParams(temperature=0, max_new_tokens=20)
    plain, _ = generate(target, token_prompts(3), params, 3)
    proposer = EagleProposer(trained_drafter, compiled=True)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found\ndetails")
    proposer.chain.fn = no_compiler
    spec, stats = generate(target, token_prompts(3), params, 3, proposer, "3_1_4")
    assert proposer.notice == "spec.compile: compiling the draft chains failed (RuntimeError: no C++ compiler " \
                              "found); they run eager"
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain] and stats.sd_steps > 0


@pytest.mark.parametrize("group_tokens", [0, None])
def test_the_prefill_hands_the_proposer_each_prompts_pairs_and_first_token(target, trained_drafter, group_tokens,
                                                                          monkeypatch):
    """After a prefill (with a group's cost at 0, one forward per prompt length) the proposer
    holds for every request the next tokens of its prompt's pairs, x_(j+1) after h_j, and the
    request's own first drawn token after the last: siblings differ there."""
    if group_tokens is not None:
        monkeypatch.setitem(engine_module.PREFILL_GROUP_TOKENS, "cpu", group_tokens)
    rows = []
    observe = EagleProposer.observe
    monkeypatch.setattr(EagleProposer, "observe", lambda self, slots, positions, hidden, next_tokens: (
        rows.extend(next_tokens.tolist()), observe(self, slots, positions, hidden, next_tokens)))
    prompts = token_prompts(6, seed=5)
    outs, _ = generate(target, prompts, SamplingParams(temperature=1.0, max_new_tokens=1, n=3, seed=1), 18,
                        EagleProposer(trained_drafter), "4_1_5")
    assert len({len(p) for p in prompts}) > 2 and len({tuple(c.token_ids) for c in outs}) > 6
    assert len(rows) == len(outs)  # max_new_tokens=1: the prefill's pairs only, one row per request
    for c in outs:
        p = prompts[c.prompt_index]
        row = next(r for r in rows if r[: len(p)] == p[1:] + c.token_ids)
        rows.remove(row)


def test_a_slot_taken_by_a_new_request_holds_only_its_pairs(target):
    """Plain steps' pairs wait in a queue; when their request finishes in the last slot (no
    move, no hidden states kept) and a new request's prefill takes the slot, the old request's
    queued pairs never land over the new one's."""
    g = torch.Generator().manual_seed(3)
    H = target.config.hidden_size
    old, new = torch.randn(2, 8, H, generator=g), torch.randn(1, 12, H, generator=g)
    with torch.inference_mode():
        proposer = EagleProposer(init_drafter(target))
        proposer.reserve(2, 16)
        proposer.observe(slice(0, 2), torch.arange(4).expand(2, 4), old[:, :4], torch.ones(2, 4, dtype=torch.long))
        for p in range(4, 8):
            proposer.observe(slice(0, 2), torch.full((2, 1), p), old[:, p:p + 1], torch.ones(2, 1, dtype=torch.long))
        proposer.admit([SimpleNamespace(slot=1)])  # slot 1's request finished; a new one took it
        proposer.observe(torch.tensor([1]), torch.arange(12)[None], new, torch.ones(1, 12, dtype=torch.long))
        dtype = proposer.features.dtype
        torch.testing.assert_close(proposer.hidden_of(1, 12), new[0].to(dtype))
        torch.testing.assert_close(proposer.hidden_of(0, 8), old[0].to(dtype))


@pytest.mark.parametrize("strategy,group_tokens", [("4_1_5", 0), ("4_2_8", 0), ("4_1_5", None)])
def test_finished_requests_hand_over_the_targets_hidden_states(target, trained_drafter, strategy, group_tokens,
                                                               monkeypatch):
    """What the adaptive drafter learns from comes from the rollout's own forwards: as each
    request finishes, its tokens and the hidden states the engine observed for those a forward
    consumed, over its prefill, plain steps (more than 3 running) and SD steps (tree or chain,
    accepted paths only), with slots compacted as requests finish and new ones admitted, equal
    one full forward of the target over those tokens, though the steps are queued and written
    together. With a prefill group's cost at 0 every
    prompt length is prefilled in its own forward; with the default, the prompts share one."""
    from tailtamer.rollout.tuner import FixedTuner

    if group_tokens is not None:
        monkeypatch.setitem(engine_module.PREFILL_GROUP_TOKENS, "cpu", group_tokens)

    repeated, rejected, write = [], [], EagleProposer._write

    def spy(self, first, positions, hidden, tokens):  # queued steps are written together
        rows = (first[:, None] + positions)[positions >= 0]
        repeated.append(len(rows) - len(rows.unique()))
        rejected.append(bool((positions < 0).any()))
        write(self, first, positions, hidden, tokens)

    monkeypatch.setattr(EagleProposer, "_write", spy)
    kept = []
    speculator = Speculator(EagleProposer(trained_drafter), FixedTuner(Strategy.parse(strategy)), bs_threshold=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, n=2, seed=4)
    prompts = token_prompts(5, seed=2)
    outs, stats = Engine(target, config=EngineConfig(max_batch_size=6), speculator=speculator).generate(
        prompts, params, keep_hidden=lambda tokens, start, hidden: kept.append((tokens, start, hidden.clone())))
    assert stats.sd_seconds > 0 and stats.plain_seconds > 0
    assert sorted(tuple(t) for t, _, _ in kept) == sorted(tuple(prompts[c.prompt_index] + c.token_ids) for c in outs)
    short = 0
    for tokens, start, hidden in kept:
        # every token but the last (which no forward consumed), or all of them when an SD step
        # accepted a draft past where the request ended
        assert len(tokens) - len(hidden) in (0, 1) and start == len(prompts[next(
            i for i, p in enumerate(prompts) if tokens[: len(p)] == p)])
        short += len(tokens) - len(hidden)
        with torch.no_grad():
            whole = target.hidden_states(torch.tensor([tokens[: len(hidden)]]))[0]
        assert torch.allclose(hidden, whole, rtol=0, atol=1e-9)
    assert short >= len(kept) // 2
    # no committed row written twice in one write, where index_copy_ leaves which value wins
    # undefined: the pairs of rejected drafts are marked, not written over later steps' pairs
    assert any(rejected) and not any(repeated)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_chain_drafts_the_same_from_the_last_steps_pairs_as_from_the_gathered_backlog(target, trained_drafter,
                                                                                        monkeypatch, batch):
    """After an SD step the next chain's backlog is that step's verified pairs, read from what
    it observed instead of gathered back out of the proposer's features: the same drafts at
    every step (requests finishing, compaction and admissions in between; at batch 1 the
    last pair is the backlog's last column, taken as a slice), and the read is taken at
    most steps."""
    params = SamplingParams(temperature=1.0, max_new_tokens=40, n=2, seed=3)
    prompts = token_prompts(5, seed=2)

    def drafts(reuse):
        proposer, trees = EagleProposer(trained_drafter), []
        chain = proposer._chain

        def spy(running, depth, floor=0.0):
            if not reuse:
                proposer.recent = None
            used = proposer.recent is not None
            tree = chain(running, depth, floor)
            trees.append((used, tree))
            return tree

        monkeypatch.setattr(proposer, "_chain", spy)
        outputs, _ = generate(target, prompts, params, batch, proposer, "4_1_5")
        return [(used, tree.tokens.tolist()) for used, tree in trees], [o.token_ids for o in outputs]

    (reused, out), (gathered, plain_out) = drafts(True), drafts(False)
    assert out == plain_out
    assert [t for _, t in reused] == [t for _, t in gathered]
    assert not any(u for u, _ in gathered) and sum(u for u, _ in reused) > len(reused) / 2
