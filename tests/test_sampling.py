"""target_probs (temperature / top-k / top-p) against hand-computed values, and the sampler's
distribution against its probabilities."""

import math

import pytest
import torch
from scipy.stats import chisquare

from tailtamer.errors import ConfigError
from tailtamer.rollout.sampling import SamplingParams, TargetDraws, gumbels, request_key, sample, target_probs

LOGITS = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))


def test_temperature_one_is_softmax():
    p = target_probs(LOGITS, SamplingParams())
    assert torch.allclose(p, torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))


def test_temperature_sharpens():
    p = target_probs(LOGITS, SamplingParams(temperature=0.5))
    w = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    assert torch.allclose(p[0], w / w.sum())


def test_top_k_keeps_the_k_largest():
    p = target_probs(LOGITS, SamplingParams(top_k=2))
    assert torch.allclose(p[0], torch.tensor([0.5 / 0.7, 0.2 / 0.7, 0, 0, 0]))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # 0.5 + 0.2 = 0.7 < 0.8, so the token that crosses 0.8 (0.15) is kept as well.
    p = target_probs(LOGITS, SamplingParams(top_p=0.8))
    assert torch.allclose(p[0], torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = target_probs(LOGITS, SamplingParams(top_p=0.7))
    assert torch.allclose(p[0], torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7, atol=1e-6)


def test_top_k_then_top_p():
    p = target_probs(LOGITS, SamplingParams(top_k=3, top_p=0.6))
    # top-3 renormalised: 0.5/0.85 = 0.588 < 0.6, so the second token is needed too.
    assert torch.allclose(p[0], torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7, atol=1e-6)


def test_greedy_is_one_hot_on_argmax():
    p = target_probs(LOGITS, SamplingParams(temperature=0))
    assert p.tolist() == [[1.0, 0, 0, 0, 0]]


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("temperature", math.inf), ("temperature", math.nan),
                                         ("top_k", -1), ("top_p", 0.0),
                                         ("top_p", 1.5), ("max_new_tokens", 0), ("n", 0)])
def test_bad_sampling_params(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})


def test_sampler_frequencies_match_probabilities():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    tokens = sample(probs.expand(4000, 5), _noise(4000, 5))
    counts = torch.bincount(tokens, minlength=5).tolist()
    assert chisquare(counts, (probs * 4000).tolist()).pvalue > 1e-3
    # a token of probability 0 is never drawn, wherever it sits
    holes = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    assert set(sample(holes.expand(4000, 5), _noise(4000, 5)).tolist()) == {1, 3}
    assert sample(torch.full((1, 5), math.nan), _noise(1, 5)).item() == -1


def test_sampler_detects_a_wrong_distribution():
    """The same check rejects samples drawn from a slightly different distribution."""
    drawn = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    tokens = sample(drawn.expand(4000, 5), _noise(4000, 5))
    counts = torch.bincount(tokens, minlength=5).tolist()
    expected = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) * 4000
    assert chisquare(counts, expected.tolist()).pvalue < 1e-3


def _noise(n, vocab, seed=7):
    """The noise of n requests of a prompt at response index 0, (n, vocab)."""
    return gumbels(torch.tensor([request_key(seed, i, 0) for i in range(n)]), torch.zeros(n, 1, dtype=torch.long),
                   vocab)[:, 0]


def test_streams_are_keyed_by_request_and_position():
    key = torch.tensor([request_key(1, 2, 3)])
    a = gumbels(key, torch.arange(5)[None], 7)
    assert a.shape == (1, 5, 7)
    assert torch.equal(a, gumbels(key, torch.arange(5)[None], 7))  # a stream is fixed by its key
    assert torch.equal(a[:, 2:4], gumbels(key, torch.tensor([[2, 3]]), 7))  # and read at any position
    assert torch.equal(a[..., :4], gumbels(key, torch.arange(5)[None], 4))  # token x's noise is x's in any vocabulary
    for other in [(1, 2, 4), (1, 3, 3), (2, 2, 3)]:
        assert not torch.equal(a, gumbels(torch.tensor([request_key(*other)]), torch.arange(5)[None], 7))
    assert math.isfinite(a.sum().item())


def test_noise_is_gumbel_and_independent():
    """Kolmogorov-Smirnov against Gumbel(0, 1) across requests, along one request's stream and
    across the vocabulary; neighbours in each of the three directions uncorrelated (a bad hash
    fails these)."""
    from scipy.stats import kstest

    keys = torch.tensor([request_key(0, i, j) for i in range(20) for j in range(20)])
    g = gumbels(keys, torch.arange(400)[None].expand(400, 400), 64)  # (requests, positions, tokens)
    for sample_ in (g[:, 0, 0], g[0, :, 0], g[0, 0], g.flatten()[::97]):
        assert kstest(sample_.numpy(), "gumbel_r").pvalue > 1e-3
    for a, b in ((g[:-1], g[1:]), (g[:, :-1], g[:, 1:]), (g[..., :-1], g[..., 1:])):
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < 0.005


@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["kept", "hashed"])
def test_target_draws_read_the_noise_of_each_requests_next_indices(budget):
    """Whether the noise is kept in windows (refilled as responses grow past them, by requests
    in any order and groups) or hashed at every call, a read is the hash of (key, index)."""
    from types import SimpleNamespace

    keys = torch.tensor([request_key(9, i, 0) for i in range(5)])
    draws = TargetDraws(SamplingParams(), keys, 11, window=8, budget=budget)
    assert (draws.table is None) == (budget == 0)
    requests = [SimpleNamespace(row=i, output_ids=[]) for i in range(5)]
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        picked = [requests[i] for i in torch.randperm(5, generator=g)[:3].tolist()]
        for r in picked:
            r.output_ids += [0] * int(torch.randint(0, 4, (1,), generator=g))
        q = int(torch.randint(1, 10, (1,), generator=g))  # 9: wider than the window, hashed directly
        offsets = torch.randint(0, q, (len(picked), q), generator=g)
        want = gumbels(keys[[r.row for r in picked]],
                       torch.tensor([[len(r.output_ids)] for r in picked]) + offsets, 11)
        assert torch.equal(draws.at(picked, offsets), want)
    assert torch.equal(draws.ahead(requests[:2], 3), gumbels(keys[:2], torch.tensor(
        [[len(r.output_ids)] for r in requests[:2]]) + torch.arange(3), 11))
