"""GRPO-family maths against hand-computed values."""

import math

import pytest
import torch

from tailtamer.rl.grpo import (ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, clipped_policy_loss, informative_groups,
                               overlong_penalty, token_entropy, token_log_probs)

R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])


def test_grpo_advantages():
    a = ADVANTAGES["grpo"](R)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert a[0].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    std2 = math.sqrt(((0.25 ** 2) * 3 + 0.75 ** 2) / 3)
    assert a[1, 3].item() == pytest.approx(-0.75 / std2, rel=1e-5)


def test_dr_grpo_and_rloo_advantages():
    assert ADVANTAGES["dr_grpo"](R)[1].tolist() == pytest.approx([0.25, 0.25, 0.25, -0.75])
    # RLOO: r_i minus the mean of the other three.
    assert ADVANTAGES["rloo"](R)[1].tolist() == pytest.approx([1 - 2 / 3, 1 - 2 / 3, 1 - 2 / 3, 0 - 1])


def test_equal_rewards_give_zero_advantage_and_are_filtered():
    # float32 means of 0.1 or 5.3 are a rounding off them; the std of that would blow it up
    same = torch.cat([torch.full((1, 8), v) for v in (1.0, 0.1, 0.7, 5.3, 10.1)])
    assert (same - same.mean(-1, keepdim=True)).abs().max() > 0  # the rounding the advantages must not keep
    for name in ADVANTAGES:
        assert torch.all(ADVANTAGES[name](same) == 0), name
        mixed = ADVANTAGES[name](torch.tensor([[0.1, 0.1, 0.2, 0.1]]))
        assert mixed[0, 2] > 0 and torch.all(mixed[0, [0, 1, 3]] < 0), name
    assert informative_groups(torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])).tolist() == [False, True, False]


def test_clipped_policy_loss_by_hand():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5, 1.1]]))
    loss, clipped = clipped_policy_loss(logp, old, torch.tensor([1.0]), clip_low=0.2, clip_high=0.28)
    # ratios 1, 1.5, 0.5, 1.1 with A = +1: min(ρ, clip(ρ, 0.8, 1.28)) = 1, 1.28, 0.5, 1.1
    assert (-loss).tolist()[0] == pytest.approx([1.0, 1.28, 0.5, 1.1])
    assert clipped.tolist() == [[False, True, False, False]]
    loss, _ = clipped_policy_loss(logp, old, torch.tensor([-1.0]), clip_low=0.2, clip_high=0.28)
    # A = −1: min(−ρ, −clip(ρ)) = −1, −1.5, −0.8, −1.1
    assert (-loss).tolist()[0] == pytest.approx([-1.0, -1.5, -0.8, -1.1])


def test_on_policy_gradient_is_the_advantage_weighted_score():
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = clipped_policy_loss(logp, logp.detach(), torch.tensor([2.0]))
    loss.sum().backward()
    assert logp.grad.tolist() == [[-2.0, -2.0, -2.0]]


def test_aggregations_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    def agg(name, **kw):
        return (loss * AGGREGATIONS[name](mask, **kw)).sum().item()

    assert agg("token-mean") == pytest.approx(10 / 4)
    assert agg("seq-mean-token-mean") == pytest.approx((2 + 4) / 2)
    assert agg("seq-mean-token-sum-norm", max_len=8) == pytest.approx((6 / 8 + 4 / 8) / 2)


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_aggregation_over_shards_equals_the_whole_batch(name):
    """Data-parallel workers each weight their shard with counts summed over all shards
    (`total`); the weights must equal those of the whole batch computed in one place."""
    mask = torch.rand(7, 6, generator=torch.Generator().manual_seed(0)) > 0.4
    mask[3] = False  # a sample with no counted token
    whole = AGGREGATIONS[name](mask, 6)
    shards = [mask[:3], mask[3:]]
    def total(x, part):  # stands in for the all-reduce: this shard's count plus the other's
        other = shards[1 - part]
        return x + {"token-mean": other.float().sum(), "seq-mean-token-mean": other.any(-1).sum().float(),
                    "seq-mean-token-sum-norm": other.any(-1).sum().float()}[name]
    parts = [AGGREGATIONS[name](m, 6, lambda x, i=i: total(x, i)) for i, m in enumerate(shards)]
    assert torch.allclose(torch.cat(parts), whole)
    assert not torch.allclose(torch.cat([AGGREGATIONS[name](m, 6) for m in shards]), whole)


def test_kl_estimators():
    logp = torch.log(torch.tensor([0.5, 0.2]))
    ref = torch.log(torch.tensor([0.25, 0.2]))
    assert KL_ESTIMATORS["k2"](logp, ref).tolist() == pytest.approx([0.5 * math.log(2) ** 2, 0.0])
    # k3 with log-ratio d = log(0.25/0.5) = −ln 2: e^d − d − 1 = 0.5 + ln 2 − 1
    assert KL_ESTIMATORS["k3"](logp, ref).tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0])
    assert KL_ESTIMATORS["low_var_kl"] is KL_ESTIMATORS["k3"] and KL_ESTIMATORS["mse"] is KL_ESTIMATORS["k2"]
    # k3 is an unbiased estimate of KL(π || π_ref) when tokens are drawn from π.
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    exact = (p * (p / q).log()).sum()
    assert (p * KL_ESTIMATORS["k3"](p.log(), q.log())).sum().item() == pytest.approx(exact.item(), rel=1e-5)


def test_kl_estimators_pull_toward_the_reference_in_expectation():
    """As a loss over tokens drawn from π (their probabilities fixed, only log π differentiated),
    k2's expected gradient is ∇KL(π‖π_ref) and k3's ∇KL(π_ref‖π); k1's would be 0. Exact
    expectations over a 6-token vocabulary, float64."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6, generator=gen, dtype=torch.float64), -1)

    def expected_grad(estimator):
        logp = torch.log_softmax(theta, -1)
        loss = (logp.exp().detach() * estimator(logp, ref)).sum()  # E_{y~π}[k(y)], π's weights not differentiated
        return torch.autograd.grad(loss, theta)[0]

    def grad_of(kl):
        return torch.autograd.grad(kl(torch.log_softmax(theta, -1)), theta)[0]

    forward = grad_of(lambda logp: (logp.exp() * (logp - ref)).sum())  # KL(π‖π_ref)
    reverse = grad_of(lambda logp: (ref.exp() * (ref - logp)).sum())  # KL(π_ref‖π)
    assert torch.allclose(expected_grad(KL_ESTIMATORS["k2"]), forward)
    assert torch.allclose(expected_grad(KL_ESTIMATORS["k3"]), reverse)
    assert torch.allclose(expected_grad(lambda logp, r: logp - r), torch.zeros(6, dtype=torch.float64))
    assert forward.abs().max() > 0.05 and reverse.abs().max() > 0.05


def test_token_log_probs_and_entropy():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    assert token_log_probs(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.25))
    assert token_entropy(logits).item() == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)))
    # At temperature 0.5 the rollout samples from p ∝ p_1^2 = (4, 1, 1) / 6: its entropy, not p_1's.
    sharp = torch.tensor([4 / 6, 1 / 6, 1 / 6])
    assert token_entropy(logits, 0.5).item() == pytest.approx(-(sharp * sharp.log()).sum().item())


def test_overlong_penalty():
    lengths = torch.tensor([10, 80, 90, 100, 120])
    assert overlong_penalty(lengths, max_len=100, buffer=20).tolist() == pytest.approx([0, 0, -0.5, -1, -1])


def test_gspo_uses_one_clipped_ratio_per_sequence():
    """GSPO (Zheng et al. 2025) by hand: s_i = exp(mean over counted tokens of log π − log π_old)."""
    import math

    from tailtamer.rl.grpo import POLICY_LOSSES

    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.3, 5.0], [-0.5, 7.0, 7.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])  # padding never counts
    loss, clipped = POLICY_LOSSES["gspo"](logp, old, torch.tensor([1.0, -1.0]), mask, 0.2, 0.28)
    s0, s1 = math.exp(0.2), math.exp(-0.5)  # 1.221 (inside the clip range), 0.607 (below 0.8)
    assert torch.allclose(loss[0], torch.full((3,), -s0), atol=1e-6)
    assert s1 < 0.8 and torch.allclose(loss[1], torch.full((3,), 0.8), atol=1e-6)  # −min(−s1, −0.8), A = −1
    assert clipped.tolist() == [[False] * 3, [True] * 3]
    (loss * mask).sum().backward()
    # GSPO-token: each counted token's gradient is −A·s_i (not s_i/|y|); clipped sequences get none
    assert torch.allclose(logp.grad, torch.tensor([[-s0, -s0, 0.0], [0.0, 0.0, 0.0]]), atol=1e-6)


def test_ppo_clip_is_a_registered_policy_loss_that_ignores_the_mask():
    from tailtamer.rl.grpo import POLICY_LOSSES

    logp, old = torch.tensor([[0.5, -0.1]]), torch.zeros(1, 2)
    a = POLICY_LOSSES["ppo-clip"](logp, old, torch.tensor([1.0]), torch.tensor([[True, False]]), 0.2, 0.28)
    b = clipped_policy_loss(logp, old, torch.tensor([1.0]), 0.2, 0.28)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
