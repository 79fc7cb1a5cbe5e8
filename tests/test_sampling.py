"""target_probs (temperature / top-k / top-p) against hand-computed values, and the sampler's
distribution against its probabilities."""

import math

import pytest
import torch
from scipy.stats import chisquare

from tailtamer.errors import ConfigError
from tailtamer.rollout.sampling import SamplingParams, request_key, sample, target_probs, uniforms

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
    tokens = sample(probs.expand(4000, 5), _uniforms(4000))
    counts = torch.bincount(tokens, minlength=5).tolist()
    assert chisquare(counts, (probs * 4000).tolist()).pvalue > 1e-3
    # a token of probability 0 is never drawn, wherever it sits
    holes = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    assert set(sample(holes.expand(4000, 5), _uniforms(4000)).tolist()) == {1, 3}


def test_sampler_detects_a_wrong_distribution():
    """The same check rejects samples drawn from a slightly different distribution."""
    drawn = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    tokens = sample(drawn.expand(4000, 5), _uniforms(4000))
    counts = torch.bincount(tokens, minlength=5).tolist()
    expected = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) * 4000
    assert chisquare(counts, expected.tolist()).pvalue < 1e-3


def _uniforms(n, seed=7):
    """One uniform each for n requests of a prompt (response index 0)."""
    return uniforms(torch.tensor([request_key(seed, i, 0) for i in range(n)]), torch.zeros(n, 1, dtype=torch.long))[:, 0]


def test_streams_are_keyed_by_request_and_position():
    key = torch.tensor([request_key(1, 2, 3)])
    a = uniforms(key, torch.arange(5)[None])
    assert torch.equal(a, uniforms(key, torch.arange(5)[None]))  # a stream is fixed by its key
    assert torch.equal(a[:, 2:4], uniforms(key, torch.tensor([[2, 3]])))  # and read at any position
    for other in [(1, 2, 4), (1, 3, 3), (2, 2, 3)]:
        assert not torch.equal(a, uniforms(torch.tensor([request_key(*other)]), torch.arange(5)[None]))
    assert math.isfinite(a.sum().item()) and 0 < a.min() and a.max() < 1


def test_uniforms_are_uniform_and_independent():
    """Kolmogorov-Smirnov across requests and along one request's stream; neighbours in either
    direction uncorrelated (a bad hash fails these)."""
    from scipy.stats import kstest

    keys = torch.tensor([request_key(0, i, j) for i in range(50) for j in range(40)])
    u = uniforms(keys, torch.arange(2000)[None].expand(2000, 2000))
    assert kstest(u[:, 0].numpy(), "uniform").pvalue > 1e-3 and kstest(u[0].numpy(), "uniform").pvalue > 1e-3
    assert kstest(u.flatten()[::37].numpy(), "uniform").pvalue > 1e-3
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < 0.005
