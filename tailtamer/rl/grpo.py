"""GRPO-family maths as small pure functions: advantages, the clipped policy loss, loss
aggregation, KL penalties, entropy, dynamic-sampling and overlong filters.

Shapes: rewards (G, n) for G prompt groups of n samples; token tensors (B, T) with a
response mask (B, T) that is True on the response tokens that count.
"""

from __future__ import annotations

from typing import Callable

import torch

# --- advantages: one scalar per sample, broadcast over its tokens -------------------------------


def agreeing(rewards: torch.Tensor) -> torch.Tensor:
    """(G, 1) True where a group's rewards are all equal. Its advantages are exactly 0: the
    float32 mean of equal rewards that are not binary fractions (0.1, 0.7) is one rounding off
    them, and a std of the same size would turn that into a sizeable advantage shared by the
    whole group."""
    return (rewards.amax(-1, keepdim=True) == rewards.amin(-1, keepdim=True))


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i − mean_g) / (std_g + ε), std unbiased over the group (Shao et al. 2024, DeepSeekMath §4.1)."""
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True) if rewards.shape[-1] > 1 else torch.zeros_like(mean)
    return ((rewards - mean) / (std + eps)).masked_fill(agreeing(rewards), 0.0)


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """A_i = r_i − mean_g: no std normalisation, whose division by a group's std weighs
    groups of nearly equal rewards (too easy or too hard) more (Liu et al. 2025, Dr. GRPO)."""
    return (rewards - rewards.mean(-1, keepdim=True)).masked_fill(agreeing(rewards), 0.0)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """A_i = r_i − mean_{j≠i} r_j = n/(n−1) · (r_i − mean_g), leave-one-out baseline (Ahmadian et al. 2024)."""
    n = rewards.shape[-1]
    if n < 2:
        return torch.zeros_like(rewards)
    return ((rewards - rewards.mean(-1, keepdim=True)) * n / (n - 1)).masked_fill(agreeing(rewards), 0.0)


ADVANTAGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages,
}

# --- per-token policy loss ----------------------------------------------------------------------


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        clip_low: float = 0.2, clip_high: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss with separate bounds (Schulman et al. 2017; DAPO clip-higher, Yu et al. 2025):

        ρ = exp(log π − log π_old),   ℓ = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A)

    advantages (B,) or (B, T). Returns (loss per token, clipped indicator per token)."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


def gspo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     clip_low: float = 3e-4, clip_high: float = 4e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token GSPO loss (Group Sequence Policy Optimization, Zheng et al. 2025, arXiv
    2507.18071, its GSPO-token form): the importance ratio of a whole response,

        s_i = exp( (1/|y_i|) Σ_t (log π(y_i,t) − log π_old(y_i,t)) )     (over its counted tokens)
        s_i,t = sg[s_i] · π(y_i,t) / sg[π(y_i,t)]                         (value s_i, gradient per token)
        ℓ_i,t = −min(s_i,t·A_i, clip(s_i,t, 1 − ε_low, 1 + ε_high)·A_i)

    so every token of a response shares the sequence's ratio and clipping (the paper clips at
    ε = 3e-4 / 4e-4: sequence ratios stay far closer to 1 than token ratios). The paper
    averages per sequence (rl.loss_agg=seq-mean-token-mean); any aggregation applies.
    advantages (B,), mask (B, T) the counted response tokens. Returns (loss, clipped) per token."""
    mask = mask.to(logp.dtype)
    length = mask.sum(1).clamp(min=1)
    log_s = ((logp - old_logp) * mask).sum(1) / length
    ratio = torch.exp(log_s.detach())[:, None] * torch.exp(logp - logp.detach())
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).expand_as(logp)


def _ppo_clip(logp, old_logp, advantages, mask, clip_low, clip_high):
    return clipped_policy_loss(logp, old_logp, advantages, clip_low, clip_high)


# The policy loss per token (rl.policy_loss), each (logp, old_logp, advantages, mask, ε_low,
# ε_high) -> (loss per token, clipped per token).
POLICY_LOSSES: dict[str, Callable] = {"ppo-clip": _ppo_clip, "gspo": gspo_policy_loss}


# --- loss aggregation: token weights w with loss = Σ ℓ·w ------------------------------------------
# Weights are computed over a whole optimizer minibatch, so summing Σ ℓ·w over its micro-batches
# (gradient accumulation) gives exactly the minibatch's aggregate. `total` sums a count over
# the minibatch's shards on every worker (identity on one worker), so data-parallel workers
# summing their gradients get the same aggregate too.


def _local(x: torch.Tensor) -> torch.Tensor:
    return x


def token_mean(mask: torch.Tensor, max_len: int | None = None, total=_local) -> torch.Tensor:
    """w = m / Σ m over the whole batch: every token weighs the same (DAPO)."""
    m = mask.float()
    return m / total(m.sum()).clamp(min=1)


def seq_mean_token_mean(mask: torch.Tensor, max_len: int | None = None, total=_local) -> torch.Tensor:
    """w = m / (Σ_t m · S) with S the sequences that have tokens: every sequence weighs the
    same (original GRPO)."""
    m = mask.float()
    per_seq = m.sum(-1, keepdim=True)
    return m / per_seq.clamp(min=1) / total(mask.any(-1).sum().float()).clamp(min=1)


def seq_mean_token_sum_norm(mask: torch.Tensor, max_len: int | None = None, total=_local) -> torch.Tensor:
    """w = m / (L · S) with a constant L (the max response length) and S the sequences that
    have tokens: no length bias (Dr. GRPO)."""
    return mask.float() / ((max_len or mask.shape[-1]) * total(mask.any(-1).sum().float()).clamp(min=1))


AGGREGATIONS: dict[str, Callable] = {
    "token-mean": token_mean, "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}

# --- KL penalty against a reference policy ------------------------------------------------------


# As a loss term over tokens drawn from π, what matters is an estimator's expected gradient
# (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL", arXiv
# 2506.09477): k1 = log π − log π_ref has E_π[∇k1] = E_π[∇log π] = 0, so it does not regularise
# at all and is refused at start-up (config.py); k2 and k3 below do, token by token (summed
# over a response they still leave out how a token's distribution moves the later ones: a
# partial gradient of the sequence-level KL, as in TRL and verl; same paper, §4).


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log π − log π_ref)² (Schulman 2020, "Approximating KL"; verl's mse). Its
    expected gradient is that of KL(π ‖ π_ref): E_π[(log π − log π_ref) ∇log π] = ∇ KL(π ‖ π_ref)."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, clamp: float = 10.0) -> torch.Tensor:
    """k3 = exp(log π_ref − log π) − (log π_ref − log π) − 1 ≥ 0 (Schulman 2020; verl's
    low_var_kl): an unbiased, low-variance estimate of KL(π ‖ π_ref), whose expected gradient
    is that of the reverse KL(π_ref ‖ π): E_π[∇k3] = −Σ π_ref ∇log π. The log-ratio is clamped
    to ±clamp and the value to at most clamp, as in verl, against overflow."""
    d = (ref_logp - logp).clamp(-clamp, clamp)
    return (torch.exp(d) - d - 1).clamp(-clamp, clamp)


KL_ESTIMATORS: dict[str, Callable] = {"k2": kl_k2, "mse": kl_k2, "k3": kl_k3, "low_var_kl": kl_k3}

# --- token statistics -----------------------------------------------------------------------------


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(token) under the sampling temperature; logits (B, T, V) predict tokens (B, T)."""
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return torch.gather(logp, -1, tokens[..., None]).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H = −Σ p log p per position (B, T), with p = softmax(logits / T): the entropy of the
    distribution the rollout samples from."""
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


# --- sample filters -------------------------------------------------------------------------------


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """(G,) True for groups whose rewards are not all equal: DAPO dynamic sampling drops the
    others, whose GRPO advantages are all zero (Yu et al. 2025)."""
    return (rewards.max(-1).values - rewards.min(-1).values) > 0


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 up to max_len − buffer, then linearly down to −1 at
    max_len (and −1 beyond)."""
    start = max_len - buffer
    return -((lengths - start).clamp(min=0) / max(1, buffer)).clamp(max=1.0)
