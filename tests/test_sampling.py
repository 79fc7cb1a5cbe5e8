"""target_probs (temperature / top-k / top-p) against hand-computed values, and the sampler's
distribution against its probabilities."""

import math

import pytest
import torch
from scipy.stats import chisquare

from tailtamer.errors import ConfigError
from tailtamer.rollout.sampling import SamplingParams, request_generator, sample, target_probs

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


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_k", -1), ("top_p", 0.0),
                                         ("top_p", 1.5), ("max_new_tokens", 0), ("n", 0)])
def test_bad_sampling_params(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})


def test_sampler_frequencies_match_probabilities():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    gens = [request_generator(7, i, 0) for i in range(4000)]
    tokens = sample(probs.expand(4000, 5), gens, greedy=False)
    counts = torch.bincount(tokens, minlength=5).tolist()
    assert chisquare(counts, (probs * 4000).tolist()).pvalue > 1e-3


def test_sampler_detects_a_wrong_distribution():
    """The same check rejects samples drawn from a slightly different distribution."""
    drawn = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    gens = [request_generator(7, i, 0) for i in range(4000)]
    tokens = sample(drawn.expand(4000, 5), gens, greedy=False)
    counts = torch.bincount(tokens, minlength=5).tolist()
    expected = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) * 4000
    assert chisquare(counts, expected.tolist()).pvalue < 1e-3


def test_request_generators_are_keyed_by_request():
    a = torch.rand(3, generator=request_generator(1, 2, 3))
    assert torch.equal(a, torch.rand(3, generator=request_generator(1, 2, 3)))
    for other in [(1, 2, 4), (1, 3, 3), (2, 2, 3)]:
        assert not torch.equal(a, torch.rand(3, generator=request_generator(*other)))
    assert math.isfinite(a.sum().item())
