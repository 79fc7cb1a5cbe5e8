"""Sampling: temperature, top-k and top-p (nucleus), drawn with counter-based random numbers.

Each request (one sample of one prompt) has a 62-bit key, `request_key(seed, prompt_index,
sample_index)`, and the token at response index t is drawn by inverse CDF (`sample`) with
`uniforms(key, t)`, a uniform hashed from the key and t. There is no generator state: a
request's draws do not depend on the batch it runs in, a whole batch (or draft tree) is sampled
in one vectorised call, and plain and speculative decoding draw the token at index t with the
same uniform whichever step emits it.

The same `target_probs` is what speculative verification must reproduce, so it is a small
pure function: filter the logits, renormalise, and nothing else.

A drafter drafts with the same uniforms (`coupled_drafts`): where the target will draw the
token at index t with u_t, the draft for it is the token the drafter's own distribution gives
for u_t, so the closer the two distributions, the likelier the two draws agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tailtamer.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()  # strings that end a response (excluded from its text)
    n: int = 1  # samples per prompt
    seed: int = 0
    logprobs: bool = False  # record each token's log-probability under the distribution it was drawn from

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ConfigError(f"n must be >= 1, got {self.n}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop strings must be non-empty, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p = renormalise(topp(topk(softmax(logits / T)))) over the last dim, in float32 or wider.

    Top-k keeps the k largest logits; top-p keeps the smallest prefix of tokens sorted by
    probability whose mass reaches p (the token that crosses p is kept; Holtzman et al. 2020).
    Greedy (T = 0) is a one-hot on the argmax.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    # softmax is shift-invariant: shifted by the max, the top logit is 0 and the rest go to -inf
    # as T -> 0 (the argmax, as it should), even where T underflows to 0 in float32
    shifted = logits - logits.amax(-1, keepdim=True)
    logits = torch.where(shifted == 0, shifted, shifted / params.temperature)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop = mass_before >= params.top_p
        drop[..., 0] = False  # the most likely token always stays (top_p may round to 0 in float32)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# A counter-based random stream per request: the uniform for the token at response index t
# is a hash of (request key, t). Plain decoding and speculative decoding draw the token at
# index t with the same uniform however many tokens a step emits, so with the same seed they
# emit the same tokens, and a whole batch (or a whole draft tree) is sampled in one vectorised
# call instead of one generator call per request. Mixing constants from C. Wellons' hash
# prospector (bias 0.107), all below 2**31 so int64 products never overflow.
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def request_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 62-bit key for the random stream of one request (one sample of one prompt)."""
    mixed = ((seed * 0x9E3779B97F4A7C15 + prompt_index) * 0xBF58476D1CE4E5B9 + sample_index) * 0x94D049BB133111EB
    mixed ^= mixed >> 31
    return mixed % (1 << 62)


def uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), float64, one per (request key, response index): keys (B,) int64,
    positions (B, ...) int64 < 2**31. 53 random bits from two 32-bit hashes."""
    k = keys.reshape(keys.shape + (1,) * (positions.dim() - 1))
    lo, hi = k & _M32, (k >> 31) & _M32
    a = _mix32(lo ^ _mix32(positions ^ hi))
    b = _mix32(hi ^ _mix32((positions + 0x5BD1E995) ^ lo))
    return ((a << 21) + (b >> 11)).double().add_(0.5).mul_(2.0 ** -53)


def sample(probs: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """One token per distribution in probs (..., V) by inverse CDF with the uniforms u (...):
    the first token whose cumulative probability reaches u (token k has chance p_k, and a
    token of probability 0 is never drawn); -1 for a distribution that is not finite.
    u = None: greedy, the argmax."""
    if u is None:
        return probs.argmax(-1)
    cdf = probs.double().cumsum(-1)
    total = cdf[..., -1]
    tokens = torch.searchsorted(cdf, (u * total).unsqueeze(-1)).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    return torch.where(torch.isfinite(total), tokens, -1)  # -1: nothing to sample from (NaN)


def coupled_drafts(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor | None) -> torch.Tensor:
    """A drafter's drafts (...) from its logits (..., V) for tokens the target will draw with
    the uniforms u (...): the tokens it would draw itself, `sample(target_probs(logits), u)`
    (greedy, u None: the argmax). A common-random-numbers coupling of the two draws: a draft
    is accepted when the target draws it (rollout/speculative.py), which with the same u
    happens with probability Σ_x |[F_q(x−1), F_q(x)) ∩ [F_p(x−1), F_p(x))| (F the CDFs in token
    order), 1 when the drafter's q equals the target's p, where a top-1 draft d is accepted
    with p(d). On the default job's trained policy at T = 1, teacher-forced: 0.896 per draft
    against 0.859 for the top-1 (docs/speculative-decoding.md). Any draft that is a function of
    the drafter and u is lossless here: the tokens emitted are the target's own draws, the
    same tokens plain decoding draws with those uniforms. So it is computed in the logits'
    precision, in a third of `sample`'s operations (a draft level is ~100 µs at batch 1), and
    filtered only when the target's draws are; a draft outside the vocabulary is clamped."""
    if u is None:
        return logits.argmax(-1)
    if params.top_k or params.top_p < 1:
        q = target_probs(logits, params)
    else:  # a temperature so small that logits / T overflow drafts garbage, which is still lossless
        q = torch.softmax(logits if params.temperature == 1 else logits / params.temperature, -1)
    cdf = q.cumsum_(-1)
    point = u.to(cdf.dtype, copy=True).mul_(cdf[..., -1])
    return torch.searchsorted(cdf, point.unsqueeze(-1)).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


@dataclass(frozen=True)
class TargetDraws:
    """How the target draws a `generate` call's tokens: its sampling parameters and the table
    of uniforms (requests, longest response + 1) the engine draws response index t with
    (`Request.row`, column t), handed to a proposer so it can draft `coupled_drafts`."""

    params: SamplingParams
    uniforms: torch.Tensor

    def at(self, requests: list, indices: torch.Tensor) -> torch.Tensor:
        """The uniforms (B, q) that draw response indices `indices` (B, q) of `requests`: the
        engine's draws and a proposer's coupled drafts read them here alike. Indices past a
        request's budget share the last column (their draws are discarded)."""
        rows = torch.tensor([r.row for r in requests], device=self.uniforms.device)[:, None]
        return self.uniforms[rows, indices.clamp(max=self.uniforms.shape[1] - 1)]

    def ahead(self, requests: list, depth: int) -> torch.Tensor:
        """(B, depth): for each request, the uniforms of the next `depth` response indices
        from len(output_ids): column k is the one the target draws the token after a draft
        tree's depth-k node with, so a level-(k + 1) draft is coupled with it."""
        first = torch.tensor([len(r.output_ids) for r in requests], device=self.uniforms.device)
        return self.at(requests, first[:, None] + torch.arange(depth, device=first.device))
