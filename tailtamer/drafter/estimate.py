"""How many tokens per target forward a drafter would give on responses it has not drafted:
the teacher-forced expected accept length, to compare drafters on the same data (the adaptive
one against a frozen copy of the warm-up drafter) without running an SD rollout.

It follows the engine's rule (rollout/speculative.py): the drafter's depth-D chain proposes at
each level its coupled draft (its top-1 when greedy), which the exact walk accepts with the
probability `chain_acceptance` gives, p the target's processed distribution (temperature,
top-p) there. Teacher-forced: level k drafts
from the target's true features of the response rather than from its own, so the estimate
approximates what a rollout measures, within a few percent either way (the drafter's own
features can be better or worse inputs); how close it comes is tested against the engine.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from tailtamer.drafter.buffer import pairs, response_window
from tailtamer.drafter.train import pack
from tailtamer.rollout.sampling import SamplingParams, target_probs


def chain_acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """α, the probability that the exact walk accepts the drafter's draft, p = target_probs of
    the target's logits and q of the drafter's. Sampled, the draft is coupled with the target's
    draw (`coupled_drafts`: both argmax_x (ln · + g_x) with the same Gumbel noise g), and both
    take x exactly when g_x − g_y > max(ln p_y − ln p_x, ln q_y − ln q_x) for every y ≠ x: by the
    Gumbel-max trick that is x winning a draw from logits c_y = max(…), c_x = 0, so
        α = Σ_x 1 / Σ_y max(p_y / p_x, q_y / q_x),
    1 when q = p, and neither the top-1's p(argmax q) nor 1 − TV(p, q) (an independent draw's).
    With tokens sorted by r = p / q, descending, max(p_y q_x, q_y p_x) is p_y q_x for y up to x
    and q_y p_x after it, so term x is p_x q_x / (q_x · P≤x + p_x · Q>x) (P, Q the sorted masses
    up to and after x): O(V log V). Greedy: p(argmax q), 1 or 0. Shape (...)."""
    p = target_probs(target_logits, params)
    if params.greedy:
        return torch.gather(p, -1, draft_logits.argmax(-1, keepdim=True)).squeeze(-1)
    p, q = p.double(), target_probs(draft_logits, params).double()
    ratio = torch.where(q > 0, p / q, torch.where(p > 0, math.inf, 0.0))  # 0/0: a token neither draws
    order = ratio.argsort(-1, descending=True)
    p, q = p.gather(-1, order), q.gather(-1, order)
    after = q.sum(-1, keepdim=True) - q.cumsum(-1)
    both = p * q
    return torch.where(both > 0, both / (q * p.cumsum(-1) + p * after), 0.0).sum(-1)


def expected_steps(alpha: np.ndarray, depth: int) -> float:
    """E[number of SD steps] to emit a response of n = len(alpha) + 1 tokens whose first one
    came from prefill, where alpha[i] is the chance the draft after response token i is
    accepted. A step with pending token i emits m tokens: m − 1 accepted drafts then one from
    the target, P(m) = Π_{j<m−1} α_{i+j} · (1 − α_{i+m−1}) for m ≤ D and Π_{j<D} α_{i+j} for
    m = D + 1; the next step starts at i + m. Drafts past the last token are never accepted.
    The accept length the engine reports is tokens / steps, so this is the denominator."""
    n = len(alpha) + 1
    a = np.zeros(n + depth + 1)
    a[: n - 1] = alpha
    start = np.zeros(n + depth + 1)
    start[0] = 1.0
    steps = 0.0
    for i in range(n - 1):
        p = start[i]
        if p == 0.0:
            continue
        steps += p
        for m in range(1, depth + 1):
            start[i + m] += p * (1.0 - a[i + m - 1])
            p *= a[i + m - 1]
        start[i + depth + 1] += p
    return steps


@torch.no_grad()
def estimate_accept_length(drafter, entries: list, depth: int, params: SamplingParams, budget: int = 2048,
                           window: int = 1024, group_tokens: int = 256,
                           should_stop: Callable[[], bool] | None = None) -> tuple[float, float]:
    """(expected accept length, expected SD steps) of `drafter`'s depth-`depth` chain on
    buffer entries: Σ tokens / Σ E[steps] over the responses, as the engine counts it (the
    steps weigh estimates of several workers into one). A metric, so it looks at an evenly
    strided subset of about `budget` pair positions (of a longer response, its first `window`
    pairs), packed about `group_tokens` at a time. It runs in idle time, so `should_stop()` is
    checked before every group: a stop ends it within one small forward and scores nothing
    (1.0, 0.0), since the groups done first hold the responses that finished first."""
    entries = [response_window(e, window) for e in entries]
    size = sum(len(e.tokens) - 1 for e in entries)
    entries = [e for e in entries[:: max(1, -(-size // budget))] if e.response_len > int(e.complete)]
    groups, group, used = [], [], 0
    for entry in entries:
        if group and used + len(entry.tokens) - 1 > group_tokens:
            groups.append(group)
            group, used = [], 0
        group.append(entry)
        used += len(entry.tokens) - 1
    if group:
        groups.append(group)
    tokens = steps = 0.0
    dtype = drafter.fc.weight.dtype
    for group in groups:
        if should_stop is not None and should_stop():
            return 1.0, 0.0
        samples = [pairs(e) for e in group]
        ids, h_in, h_next, _, positions, attn = pack(samples)
        logits, _ = drafter(ids, h_in.to(dtype), positions, attn)
        alpha = chain_acceptance(drafter.target.lm_head(h_next.to(dtype)), logits, params)[0]
        for entry, part in zip(group, alpha.split([len(x[0]) for x in samples])):
            # pair j holds the pending token x_{j+1}; the response's tokens start at pair start − 1,
            # and the last pair of a complete entry predicts past the response's end
            response = part[entry.response_start - 1: len(part) - entry.complete].double().cpu().numpy()
            tokens += entry.response_len - entry.complete
            steps += expected_steps(response, depth)
    return (tokens / steps if steps else 1.0), steps
