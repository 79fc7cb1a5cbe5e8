"""Online DataBuffer (alignment, budget, one-step offset), sequence packing, the spot trainer
(preemption, learning, selective checkpoint) and the acceptance estimates."""

import random

import numpy as np

import pytest
import torch

from tailtamer.drafter.buffer import DataBuffer, Entry, pairs
from tailtamer.drafter.estimate import chain_acceptance, estimate_accept_length, expected_steps
from tailtamer.drafter.spot import SpotConfig, SpotTrainer
from tailtamer.drafter.train import pack
from tailtamer.errors import ConfigError
from tailtamer.model.drafter import init_drafter, load_drafter, weights_checksum
from tailtamer.rl.batching import response_batch
from tailtamer.rollout.sampling import SamplingParams, coupled_drafts, gumbels, request_key, sample, target_probs
from conftest import random_model

T1 = SamplingParams(temperature=1.0)

H = 4


def add_batch(buf: DataBuffer, step: int, ids: torch.Tensor, hidden: torch.Tensor,
              response_mask: torch.Tensor) -> int:
    """Add every sample of a (B, T) batch, with the hidden states of a forward over all of it,
    whose `response_mask` (B, T - 1; True where the next token is a response token, as the RL
    step builds it) has any token, through `add_response`. Returns the number added."""
    added = 0
    for b in range(ids.shape[0]):
        where = response_mask[b].nonzero()
        if len(where):
            end = int(where[-1]) + 2
            added += buf.add_response(step, ids[b, :end].tolist(), int(where[0]) + 1, hidden[b, :end])
    return added


def _position_hidden(length: int, offset: float = 0.0) -> torch.Tensor:
    """hidden[t] = (t + offset) in every channel, so alignment errors are visible."""
    return (torch.arange(length, dtype=torch.float) + offset)[:, None].expand(length, H).clone()


def test_buffer_pairs_align_h_t_with_x_t_plus_1_over_response_tokens():
    # Two samples: prompt [5, 6, 7] + response [8, 9, 1] and prompt [5, 6] + response [4, 1].
    batch = [{"prompt_ids": [5, 6, 7]}, {"prompt_ids": [5, 6]}]

    class C:  # the engine's Completion, reduced to what response_batch reads
        def __init__(self, i, toks):
            self.prompt_index, self.token_ids = i, toks

    ids, mask = response_batch(batch, [C(0, [8, 9, 1]), C(1, [4, 1])], pad_id=0)
    hidden = torch.stack([_position_hidden(ids.shape[1], 100 * b) for b in range(2)])
    buf = DataBuffer(10**6)
    assert add_batch(buf, step=3, ids=ids, hidden=hidden, response_mask=mask) == 2
    first, second = buf.entries
    assert first.tokens.tolist() == [5, 6, 7, 8, 9, 1] and first.response_start == 3
    assert second.tokens.tolist() == [5, 6, 4, 1] and second.response_start == 2  # padding cut off
    x_in, h_in, h_next, m = pairs(first)
    for t in range(len(x_in)):
        assert x_in[t] == first.tokens[t + 1]  # token x_{t+1} ...
        assert h_in[t, 0] == t and h_next[t, 0] == t + 1  # ... beside feature h_t, predicting h_{t+1}
    # Counted pairs are those whose input token x_{t+1} is a response token: 8, 9, 1.
    assert x_in[m].tolist() == [8, 9, 1]
    assert pairs(second)[0][pairs(second)[3]].tolist() == [4, 1]


def test_buffer_budget_drops_the_oldest_and_counts():
    entry = lambda step, n: Entry(step, torch.zeros(n, dtype=torch.long), torch.zeros(n, H), 1)  # noqa: E731
    size = entry(0, 10).nbytes
    buf = DataBuffer(max_bytes=3 * size)
    for step in range(5):
        buf.add(entry(step, 10))
    assert [e.step for e in buf.entries] == [2, 3, 4] and buf.dropped == 2 and buf.nbytes == 3 * size
    long = Entry(9, torch.arange(1000), _position_hidden(1000), 10)
    buf.add(long)  # larger than the whole budget: its last part that fits (30 tokens), which takes all of it
    assert [e.step for e in buf.entries] == [9] and buf.dropped == 5 and buf.nbytes <= 3 * size
    kept = buf.entries[0]
    assert kept.tokens.tolist() == list(range(970, 1000)) and kept.hidden[0, 0] == 970 and kept.response_start == 1
    assert all(pairs(kept)[3])  # every pair of the tail is a response pair


def test_a_long_response_is_trained_and_scored_a_window_at_a_time():
    """A drafter step and the estimate stay their size (a packed row's mask is n²): a random
    window of the response's pairs for a step, the first ones for the estimate."""
    entry = Entry(0, torch.arange(5000), _position_hidden(5000), 100)
    buf = DataBuffer(10**9)
    buf.add(entry)
    for seed in range(20):
        (window,) = buf.sample(random.Random(seed), max_tokens=512)
        start = int(window.tokens[0])
        assert len(window.tokens) == 513 and window.tokens.tolist() == list(range(start, start + 513))
        assert 99 <= start <= 5000 - 513 and window.hidden[:, 0].tolist() == [float(t) for t in window.tokens]
        x_in, h_in, h_next, mask = pairs(window)
        assert mask.all() and (h_next[:, 0] - h_in[:, 0] == 1).all()  # h_t beside x_{t+1}, predicting h_{t+1}
    assert len({int(w.tokens[0]) for w in (buf.sample(random.Random(s), 512)[0] for s in range(20))}) > 10
    target = random_model()
    drafter = init_drafter(target, seed=1)
    lengths = []
    real = drafter.forward
    drafter.forward = lambda ids, *a, **k: lengths.append(ids.shape[1]) or real(ids, *a, **k)
    tokens = torch.randint(3, target.config.vocab_size, (1000,))
    hidden = target.hidden_states(tokens[None])[0]
    value, steps = estimate_accept_length(drafter, [Entry(0, tokens, hidden, 20)], 3, T1, window=128)
    assert lengths == [128] and 1 <= value and steps > 0


def test_one_step_offset_mixes_newest_step_with_previous_long_ones():
    buf = DataBuffer(10**8)
    for step, lengths in ((0, [50, 60]), (1, [5, 10, 40, 80]), (2, [3, 4, 6])):
        for n in lengths:
            buf.add(Entry(step, torch.zeros(n + 2, dtype=torch.long), torch.zeros(n + 2, H), 2))
    pool = buf.candidates(long_quantile=0.5)
    assert sorted((e.step, e.response_len) for e in pool) == [(1, 40), (1, 80), (2, 3), (2, 4), (2, 6)]
    drawn = buf.sample(random.Random(0), max_tokens=10**6)
    assert sorted(e.response_len for e in drawn) == sorted(e.response_len for e in pool)
    small = buf.sample(random.Random(0), max_tokens=12)
    assert 1 <= len(small) and sum(len(e.tokens) - 1 for e in small) <= max(12, len(small[0].tokens) - 1)


def test_packing_keeps_samples_apart():
    a = [torch.tensor([1, 2, 3]), _position_hidden(3), _position_hidden(3, 1), torch.tensor([False, True, True])]
    b = [torch.tensor([4, 5]), _position_hidden(2, 10), _position_hidden(2, 11), torch.tensor([True, True])]
    tokens, h_in, h_next, mask, positions, attn = pack([a, b])
    assert tokens.tolist() == [[1, 2, 3, 4, 5]] and mask.tolist() == [[False, True, True, True, True]]
    assert positions.tolist() == [[0, 1, 2, 0, 1]]  # restart per sample
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]],
                            dtype=torch.bool)
    assert torch.equal(attn[0], expected)  # causal inside a sample, nothing across samples


def test_packed_drafter_forward_equals_separate_forwards():
    target = random_model()
    drafter = init_drafter(target, seed=1)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for n in (5, 3, 7):
        samples.append([torch.randint(3, 90, (n,), generator=gen), torch.randn(n, 64, generator=gen),
                        torch.randn(n, 64, generator=gen), torch.ones(n, dtype=torch.bool)])
    tokens, h_in, _, _, positions, attn = pack(samples)
    with torch.no_grad():
        packed_logits, _ = drafter(tokens, h_in, positions, attn)
        alone = torch.cat([drafter(s[0][None], s[1][None])[0][0] for s in samples])
    torch.testing.assert_close(packed_logits[0], alone, atol=1e-5, rtol=1e-5)


def _buffer_from_target(target, n=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    buf = DataBuffer(10**8)
    for step in (0, 1):
        for _ in range(n):
            ids = torch.randint(3, 90, (1, 24), generator=gen)
            with torch.no_grad():
                _, hidden = target(ids)
            mask = torch.zeros(1, 23, dtype=torch.bool)
            mask[0, 4:] = True
            add_batch(buf, step, ids, hidden, mask)
    return buf


@pytest.mark.parametrize("stop_at", [5, 6])  # the 5th poll is before step 3's forward, the 6th before its backward
def test_spot_trainer_is_preempted_before_a_steps_forward_or_its_backward(stop_at):
    target = random_model()
    drafter = init_drafter(target, seed=1)
    trainer = SpotTrainer(drafter, _buffer_from_target(target), SpotConfig(tokens_per_step=64))
    polls, at_stop = [], []

    def stop():
        polls.append(trainer.steps)
        if len(polls) == stop_at:
            at_stop.append(weights_checksum(drafter))
        return len(polls) >= stop_at

    report = trainer.train(stop)
    # Checked twice a step: two steps ran, and the stopped one changed nothing, not even the optimizer.
    assert polls == [0, 0, 1, 1, 2, 2][:stop_at]
    assert report["steps"] == trainer.steps == 2 and report["preempt_latency_s"] >= 0
    assert weights_checksum(drafter) == at_stop[0]
    assert {int(state["step"]) for state in trainer.optimizer.state.values()} == {2}


def test_spot_training_lowers_the_drafter_loss_and_leaves_the_target_alone():
    target = random_model()
    before = weights_checksum(target)
    grads_before = [p.requires_grad for p in target.parameters()]
    buf = _buffer_from_target(target)
    trainer = SpotTrainer(init_drafter(target, seed=1), buf, SpotConfig(tokens_per_step=256, lr=3e-3, max_steps=40))
    first = trainer.step()
    report = trainer.train(lambda: False)
    later = trainer.train(lambda: False)
    assert report["steps"] == later["steps"] == 40
    assert later["loss"] < report["loss"] < first, (first, report["loss"], later["loss"])
    assert weights_checksum(target) == before and [p.requires_grad for p in target.parameters()] == grads_before
    assert all(p.grad is None for p in target.parameters())


def test_selective_async_checkpoint_holds_only_drafter_tensors(tmp_path):
    target = random_model()
    drafter = init_drafter(target, seed=1)
    trainer = SpotTrainer(drafter, _buffer_from_target(target), SpotConfig(tokens_per_step=64))
    trainer.checkpoint_async(tmp_path / "d")
    snapshot = weights_checksum(drafter)
    trainer.step()  # training goes on while the copy is written
    trainer.wait()
    loaded = load_drafter(tmp_path / "d", target)
    assert weights_checksum(loaded) == snapshot != weights_checksum(drafter)
    from safetensors.torch import load_file
    keys = load_file(str(tmp_path / "d" / "model.safetensors")).keys()
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in keys)


def test_chain_acceptance_is_the_agreement_of_the_coupled_draws():
    p = torch.tensor([[0.5, 0.3, 0.2]]).log()
    q = torch.tensor([[0.2, 0.7, 0.1]]).log()
    # Σ_x 1 / Σ_y max(p_y / p_x, q_y / q_x): x = 0: 1 / (1 + 3.5 + .5); x = 1: 1 / (5/3 + 1 + 2/3);
    # x = 2: 1 / (2.5 + 7 + 1)
    assert chain_acceptance(p, q, T1).item() == pytest.approx(1 / 5 + 3 / 10 + 2 / 21)
    keys = torch.tensor([request_key(0, i, 0) for i in range(200_000)])
    noise = gumbels(keys, torch.zeros(len(keys), 1, dtype=torch.long), 3)[:, 0]
    agree = coupled_drafts(q.expand(len(keys), 3), T1, noise) == sample(target_probs(p.expand(len(keys), 3), T1), noise)
    assert agree.double().mean().item() == pytest.approx(1 / 5 + 3 / 10 + 2 / 21, abs=0.005)
    assert chain_acceptance(p, p, T1).item() == pytest.approx(1.0)  # a drafter equal to the target
    assert chain_acceptance(p, q, SamplingParams(temperature=0)).item() == 0.0  # greedy: argmax q = 1, not 0
    # with top-p 0.6 the target samples tokens 0 and 1 (.625, .375), the drafter token 1 alone
    assert chain_acceptance(p, q, SamplingParams(top_p=0.6)).item() == pytest.approx(0.375)


def test_expected_steps_by_hand():
    # 4 tokens, depth 1: from token 0, one step emits 1 (p .5) or 2 tokens (p .5) ...
    alpha = [0.5, 0.5, 0.5]
    # start probabilities: s0 = 1, s1 = .5, s2 = .5·.5 + .5 = .75, s3 never starts a step (last token)
    assert expected_steps(np.array(alpha), depth=1) == pytest.approx(1 + 0.5 + 0.75)
    assert expected_steps(np.array([1.0, 1.0, 1.0]), depth=3) == pytest.approx(1.0)
    assert expected_steps(np.array([0.0, 0.0, 0.0]), depth=3) == pytest.approx(3.0)
    # a response shorter than the depth (one token after prefill: no SD step at all) does not crash
    assert expected_steps(np.array([]), depth=4) == 0.0
    assert expected_steps(np.array([0.9]), depth=4) == pytest.approx(1.0)


def _rollout_and_estimate(model, drafter, prompts, strategy: str, temperature: float):
    """The engine's measured accept length with `drafter` on a rollout, and the estimate on
    the same responses (their target hidden states, as the RL step's buffer holds them)."""
    from tailtamer.rollout.engine import Engine, EngineConfig
    from tailtamer.rollout.eagle import EagleProposer
    from tailtamer.rollout.speculative import Strategy
    from tailtamer.rollout.speculator import Speculator

    engine = Engine(model, None, EngineConfig(max_batch_size=48), eos_ids=(1,),
                    speculator=Speculator.fixed(EagleProposer(drafter), strategy))
    params = SamplingParams(temperature=temperature, max_new_tokens=40, n=2, seed=4)
    completions, stats = engine.generate(prompts, params)
    ids, mask = response_batch([{"prompt_ids": p} for p in prompts], completions, pad_id=0)
    buf = DataBuffer(10**9)
    with torch.no_grad():
        add_batch(buf, 0, ids, model(ids)[1], mask)
    estimate, _ = estimate_accept_length(drafter, list(buf.entries), Strategy.parse(strategy).depth, params,
                                         budget=10**9)
    return stats.accept_len_mean, estimate


def _bigram_target():
    """A random model whose layers add nothing (zero output projections): its next token
    depends on the last token only, peaked enough (LM head std 0.6) for a drafter to learn it."""
    model = random_model()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()  # (the layers' biases feed nothing then)
        model.lm_head.weight.normal_(0, 0.6, generator=torch.Generator().manual_seed(5))
    return model


def test_the_estimate_matches_the_engines_measured_accept_length():
    """On the same responses the estimate is within 5% of what the engine measured, for a
    random drafter (accept length ~1; the 1 − TV formula said 4.4 where 1.01 was measured)
    and a trained one, sampled (coupled drafts) and greedy, chains of depth 4 and 2."""
    from tailtamer.drafter.train import DrafterTrainConfig, train_drafter
    from tailtamer.rollout.engine import Engine, EngineConfig

    model = _bigram_target()
    prompts = torch.randint(3, 90, (16, 5), generator=torch.Generator().manual_seed(0)).tolist()
    own, _ = Engine(model, None, EngineConfig(max_batch_size=128), eos_ids=(1,)).generate(
        prompts, SamplingParams(temperature=1.0, n=8, max_new_tokens=40, seed=9))
    trained, _ = train_drafter(model, [prompts[c.prompt_index] + c.token_ids for c in own],
                               DrafterTrainConfig(steps=150, batch_size=16, lr=3e-3), log=lambda _: None)
    seen = []
    for drafter in (init_drafter(model, seed=1), trained):
        for strategy, temperature in (("4_1_5", 1.0), ("4_1_5", 0.0), ("2_1_3", 1.0)):
            measured, estimate = _rollout_and_estimate(model, drafter, prompts, strategy, temperature)
            seen.append(measured)
            assert estimate == pytest.approx(measured, rel=0.05), (strategy, temperature)
    assert min(seen) < 1.1 and max(seen) > 2.0  # both regimes were exercised


def test_accept_length_estimate_packs_without_chains_across_samples():
    """Packed in groups, the estimate equals the step-weighted mean of each entry's own
    estimate (a chain never runs into the next sample), and it ranks drafters: the trained
    one beats the random one it started from."""
    target = random_model()
    drafter = init_drafter(target, seed=1)
    entries = list(_buffer_from_target(target, n=6).entries)
    whole, n = estimate_accept_length(drafter, entries, 3, T1, budget=10**6, group_tokens=50)
    alone = [estimate_accept_length(drafter, [e], 3, T1) for e in entries]
    assert n == pytest.approx(sum(k for _, k in alone))
    assert whole == pytest.approx(sum(v * k for v, k in alone) / n, rel=1e-5)
    strided, m = estimate_accept_length(drafter, entries, 3, T1, budget=100)
    assert m < n and strided >= 1.0
    # idle time's stop signal, checked before every group of about group_tokens pairs: a stop
    # after the first forward scores nothing rather than the entries that happened to go first
    forwards, polls = [], []
    real = drafter.forward
    drafter.forward = lambda ids, *a, **k: forwards.append(ids.shape[1]) or real(ids, *a, **k)
    assert estimate_accept_length(drafter, entries, 3, T1, budget=10**6, group_tokens=50,
                                  should_stop=lambda: polls.append(1) or len(polls) > 1) == (1.0, 0.0)
    assert len(forwards) == 1 and len(polls) == 2 and forwards[0] <= 50
    assert estimate_accept_length(drafter, entries, 3, T1, budget=10**6, group_tokens=50,
                                  should_stop=lambda: False) == (whole, n)
    assert len(forwards) > 2 and max(forwards) <= 50
    del drafter.forward
    buf = _buffer_from_target(target, n=6)
    trainer = SpotTrainer(drafter, buf, SpotConfig(tokens_per_step=256, lr=3e-3, max_steps=40))
    before = estimate_accept_length(init_drafter(target, seed=1), entries, 3, T1)[0]
    trainer.train(lambda: False)
    assert estimate_accept_length(drafter, entries, 3, T1)[0] > before


def test_spot_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="spot.single_worker"):
        SpotConfig(single_worker="sometimes")
    with pytest.raises(ConfigError, match="spot.tokens_per_step must be >= 1"):
        SpotConfig(tokens_per_step=0)
    with pytest.raises(ConfigError, match="spot.unroll must be at most 64, the deepest draft, got 65"):
        SpotConfig(unroll=65)
    SpotConfig(unroll=64)


def test_packing_keeps_every_tensor_on_the_buffers_device():
    """On a GPU the buffer holds CUDA tensors: positions, masks and the attention mask must
    follow them (the meta device stands in for one here)."""
    entries = [Entry(0, torch.arange(n, device="meta"), torch.zeros(n, 4, device="meta"), 2) for n in (5, 3)]
    assert {t.device.type for t in pack([pairs(e) for e in entries])} == {"meta"}



def test_a_rollout_response_enters_the_buffer_with_its_pairs_aligned():
    """`add_response` (what the engine hands over as a request finishes): all its tokens and
    the hidden states of those a forward consumed (all but the last here); the pairs start at
    the prompt's last position, and a response with no consumed token gives no entry."""
    buf = DataBuffer(1 << 20)
    prompt, response = [5, 6, 7], [8, 9, 10, 1]
    hidden = _position_hidden(6)
    assert buf.add_response(2, prompt + response, len(prompt), hidden)
    assert not buf.add_response(2, prompt + [1], len(prompt), _position_hidden(3))  # the first token was EOS
    (entry,) = buf.entries
    tokens_in, h_in, h_target, mask = pairs(entry)
    assert entry.step == 2 and entry.response_len == 3 and not entry.complete
    assert tokens_in[mask].tolist() == response[:-1] and h_in[mask, 0].tolist() == [2, 3, 4]
    assert h_target[mask, 0].tolist() == [3, 4, 5]
    hidden[:] = -1  # the engine reuses its buffer: the entry holds a copy
    assert entry.hidden[0, 0] == 0


def test_the_estimate_of_a_rollout_entry_is_that_of_the_whole_response():
    """A rollout's entry lacks the last token's hidden state (no forward consumed it); the
    accept-length estimate counts its last pair, which predicts a real token, so it equals
    the estimate from a full forward over the whole response."""
    target = random_model()
    drafter = init_drafter(target, seed=1, std=0.2)
    ids = torch.randint(3, target.config.vocab_size, (4, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = target.hidden_states(ids)
    whole, rollout = DataBuffer(1 << 24), DataBuffer(1 << 24)
    mask = torch.zeros(4, 29, dtype=torch.bool)
    mask[:, 5:] = True  # prompts of 6 tokens
    add_batch(whole, 0, ids, hidden, mask)
    for b in range(4):
        rollout.add_response(0, ids[b].tolist(), 6, hidden[b, :-1])
    a = estimate_accept_length(drafter, whole.newest(), 3, T1)
    b = estimate_accept_length(drafter, rollout.newest(), 3, T1)
    assert a[0] > 1.0 and a == pytest.approx(b, rel=1e-5)
