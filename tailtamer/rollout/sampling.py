"""Sampling: temperature, top-k and top-p (nucleus), drawn with counter-based random numbers.

Each request (one sample of one prompt) has a 62-bit key, `request_key(seed, prompt_index,
sample_index)`, and the token at response index t is drawn by the Gumbel-max trick (`sample`):
argmax_x (log p_x + g_x) with `gumbels(key, t)`, a vector of Gumbel noise (one per vocabulary
entry) hashed from the key, t and x. There is no generator state: a request's draws do not
depend on the batch it runs in, a whole batch (or draft tree) is sampled in one vectorised
call, and plain and speculative decoding draw the token at index t with the same noise
whichever step emits it.

The same `target_probs` is what speculative verification must reproduce, so it is a small
pure function: filter the logits, renormalise, and nothing else.

A drafter drafts with the same noise (`coupled_drafts`): where the target will draw the token
at index t with g_t, the draft for it is the token the drafter's own distribution gives for
g_t, so the closer the two distributions, the likelier the two draws agree.
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


# A counter-based random stream per request: the noise for the token at response index t is
# a hash of (request key, t, token). Plain decoding and speculative decoding draw the token at
# index t with the same noise however many tokens a step emits, so with the same seed they
# emit the same tokens, and a whole batch (or a whole draft tree) is sampled in one vectorised
# call instead of one generator call per request. Mixing constants from C. Wellons' hash
# prospector (bias 0.107), all below 2**31 so int64 products never overflow.
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """x (32-bit values in int64) mixed in place, so pass a temporary: `gumbels` mixes V
    entries per drawn token, and copies at each operation cost as much as the mixing."""
    x ^= x >> 16
    x.mul_(0x21F0AAAD).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(0x735A2D97).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 15)


def request_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 62-bit key for the random stream of one request (one sample of one prompt)."""
    mixed = ((seed * 0x9E3779B97F4A7C15 + prompt_index) * 0xBF58476D1CE4E5B9 + sample_index) * 0x94D049BB133111EB
    mixed ^= mixed >> 31
    return mixed % (1 << 62)


# A 32-bit tag per vocabulary entry, so one (key, t) stream gives every token its own noise.
_LANES: dict = {}


def _lanes(vocab: int, device) -> torch.Tensor:
    if (vocab, device) not in _LANES:
        _LANES[vocab, device] = _mix32(torch.arange(vocab, device=device) ^ 0x68E31DA4)
    return _LANES[vocab, device]


def gumbels(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise (..., vocab), float64, one vector per (request key, response index):
    keys (B,) int64, positions (B, ...) int64 < 2**31. Each entry is −ln(−ln u), u in (0, 1)
    from a 32-bit hash of the token's tag and two 32-bit words of (key, position): one mix per
    entry, since hashing V entries per drawn token is where a draw's time goes."""
    k = keys.reshape(keys.shape + (1,) * (positions.dim() - 1))
    lo, hi = k & _M32, (k >> 31) & _M32
    a = _mix32(lo ^ _mix32(positions ^ hi))[..., None]
    b = _mix32(hi ^ _mix32((positions + 0x5BD1E995) ^ lo))[..., None]
    x = _mix32(((a ^ _lanes(vocab, positions.device)) + b).bitwise_and_(_M32))
    u = x.double().add_(0.5).mul_(2.0 ** -32)
    return u.log_().neg_().log_().neg_()


def sample(probs: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    """One token per distribution in probs (..., V) by the Gumbel-max trick with the noise g
    (..., V): argmax_x (ln p_x + g_x), which is token x with chance p_x (Gumbel 1954; Maddison
    et al. 2014); a token of probability 0 is never drawn; -1 for a distribution that is not
    finite. g = None: greedy, the argmax."""
    if g is None:
        return probs.argmax(-1)
    p = probs.double()
    tokens = p.log().add_(g).argmax(-1)
    return torch.where(torch.isfinite(p.sum(-1)), tokens, -1)  # -1: nothing to sample from (NaN)


def perturbed(logits: torch.Tensor, params: SamplingParams, g: torch.Tensor) -> torch.Tensor:
    """A drafter's log-probabilities, up to a constant, plus the target's noise g (..., V): its
    argmax is `coupled_drafts`' draft, its top-k the Gumbel-top-k (distinct tokens, the k a
    draw from q without replacement would give; Kool et al. 2019). Filtered only when the
    target's draws are; a temperature so small that logits / T overflow drafts garbage, which
    is still lossless. In the logits' precision: the noise is rounded to it (a draft need only
    be a function of the drafter and the noise)."""
    if params.top_k or params.top_p < 1:
        scores = target_probs(logits, params).log()
    else:
        scores = logits if params.temperature == 1 else logits / params.temperature
    return scores + g.to(scores.dtype)


def coupled_drafts(logits: torch.Tensor, params: SamplingParams, g: torch.Tensor | None) -> torch.Tensor:
    """A drafter's drafts (...) from its logits (..., V) for tokens the target will draw with
    the noise g (..., V): the tokens it would draw itself, `sample(target_probs(logits), g)`
    (greedy, g None: the argmax). A common-random-numbers coupling of the two draws, the
    Gumbel-max coupling: a draft is accepted when the target draws it (rollout/speculative.py),
    which happens with probability Σ_x 1 / Σ_y max(p_y / p_x, q_y / q_x)
    (`drafter.estimate.chain_acceptance`), 1 when the drafter's q equals the target's p, where
    a top-1 draft d is accepted with p(d). On the base model and its warm-up drafter at T = 1,
    teacher-forced: 0.888 per draft against 0.865 for inverse-CDF coupling with one uniform and
    0.845 for the top-1 (docs/speculative-decoding.md). Any draft that is a function of the
    drafter and g is lossless here: the tokens emitted are the target's own draws, the same
    tokens plain decoding draws with that noise. An add and an argmax (no softmax at T = 1), in
    the logits' precision."""
    if g is None:
        return logits.argmax(-1)
    return perturbed(logits, params, g).argmax(-1)


# A generate call keeps each request's noise for this many response indices, while all its
# requests' fit in the budget (bytes): hashed for 64 indices at once, the 11-token answers of
# the default job's first step left most of it unread (10 ms of a 300 ms rollout).
NOISE_WINDOW, NOISE_BUDGET = 32, 64 << 20


def noise_table_bytes(requests: int, vocab: int, window: int = NOISE_WINDOW, budget: int = NOISE_BUDGET) -> int:
    """The bytes `TargetDraws` keeps for a generate call's noise: all or nothing."""
    size = requests * window * vocab * 8
    return size if size <= budget else 0


class TargetDraws:
    """How the target draws a `generate` call's tokens: its sampling parameters, the requests'
    keys (in `Request.row` order) and the vocabulary size, handed to a proposer so it can draft
    `coupled_drafts`.

    The noise is hashed once per `window` response indices of a request and kept (requests ×
    window × V, float64, where that fits in `budget` bytes; else hashed at every call): a
    decode step reads a few indices past each running request's output, and a hash call costs
    ~0.2 ms at batch 1 on a CPU, more than the sampling."""

    def __init__(self, params: SamplingParams, keys: torch.Tensor, vocab: int, window: int = NOISE_WINDOW,
                 budget: int = NOISE_BUDGET):
        self.params, self.keys, self.vocab, self.window = params, keys, vocab, window
        kept = noise_table_bytes(keys.numel(), vocab, window, budget) > 0
        self.table = torch.empty(keys.numel(), window, vocab, dtype=torch.float64, device=keys.device) if kept else None
        self.base = [-window] * keys.numel()  # per row, the response index of its window's column 0

    def at(self, requests: list, offsets: torch.Tensor) -> torch.Tensor:
        """The noise (B, q, V) that draws response indices len(output_ids) + offsets of
        `requests`, offsets (B, q) or (1, q) in [0, q): the engine's draws and a proposer's
        coupled drafts read it here alike."""
        device, q = self.keys.device, offsets.shape[-1]
        firsts = [len(r.output_ids) for r in requests]
        rows = [r.row for r in requests]
        if self.table is None or q > self.window:
            indices = torch.tensor(firsts, device=device)[:, None] + offsets
            return gumbels(self.keys[torch.tensor(rows, device=device)], indices, self.vocab)
        stale = [(row, f) for row, f in zip(rows, firsts) if not self.base[row] <= f <= self.base[row] + self.window - q]
        if stale:
            for row, f in stale:
                self.base[row] = f
            again = torch.tensor([row for row, _ in stale], device=device)
            self.table[again] = gumbels(self.keys[again], torch.tensor([f for _, f in stale], device=device)[:, None]
                                        + torch.arange(self.window, device=device), self.vocab)
        shift = torch.tensor([[f - self.base[row]] for row, f in zip(rows, firsts)], device=device)
        return self.table[torch.tensor(rows, device=device)[:, None], shift + offsets]

    def ahead(self, requests: list, depth: int) -> torch.Tensor:
        """(B, depth, V): for each request, the noise of the next `depth` response indices from
        len(output_ids): column k is the one the target draws the token after a draft tree's
        depth-k node with, so a level-(k + 1) draft is coupled with it."""
        return self.at(requests, torch.arange(depth, device=self.keys.device)[None])
