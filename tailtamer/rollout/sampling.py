"""Sampling: temperature, top-k and top-p (nucleus) with one generator per request.

The same `target_probs` is what speculative verification must reproduce, so it is a small
pure function: filter the logits, renormalise, and nothing else.
"""

from __future__ import annotations

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

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
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
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generators: list[torch.Generator], greedy: bool) -> torch.Tensor:
    """One token per row of probs (B, V), row i drawn with generators[i] only, so a request's
    sample never depends on which other requests share its batch."""
    if greedy:
        return probs.argmax(-1)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])


def request_generator(seed: int, prompt_index: int, sample_index: int, device="cpu") -> torch.Generator:
    """A generator keyed by (seed, prompt, sample): the stream is fixed by the request alone."""
    g = torch.Generator(device=device)
    mixed = ((seed * 0x9E3779B97F4A7C15 + prompt_index) * 0xBF58476D1CE4E5B9 + sample_index) * 0x94D049BB133111EB
    g.manual_seed(mixed % (1 << 63))
    return g
