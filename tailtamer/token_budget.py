"""Rows of unequal widths cut into padded chunks, within a token budget, at the least cost."""

from __future__ import annotations


# A forward+backward call's fixed cost, in tokens of work, for the built-in base model (per-
# operation overhead; measured 2026-12-04 by fitting time = fixed + tokens / rate over batch
# shapes): ~50 tokens at one thread (the default job's workers: ~6 ms fixed, ~8,000 tokens/s)
# and ~180 at two (~15 ms, ~11,600 tokens/s). In between, on the default job's minibatches the
# cuts differ from either end's by one or two calls, under 5% of the modelled cost.
CALL_OVERHEAD_TOKENS = 128


def token_budget_chunks(widths: list[int], max_rows: int, max_tokens: int,
                        overhead: int = CALL_OVERHEAD_TOKENS) -> list[list[int]]:
    """Indices of `widths` in ascending width, cut into chunks (micro-batches, each padded to
    its widest) of at most `max_rows` rows and `max_rows x width` <= `max_tokens` padded
    tokens (a row wider than the budget goes alone), choosing the cuts that minimise

        sum over chunks of (overhead + rows x widest)

    by dynamic programming over the sorted widths: one chunk padded to the longest of a
    long-tailed batch wastes most of its compute on padding, many small chunks pay the
    per-call cost many times (verl's dynamic batch size, with the cut points optimised)."""
    order = sorted(range(len(widths)), key=lambda i: (widths[i], i))
    w = [widths[i] for i in order]
    n = len(w)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):  # best[j]: the first j sorted rows in chunks; chunk (i, j] ends at w[j-1]
        for i in range(j - 1, max(-1, j - 1 - max_rows), -1):
            if j - i > 1 and (j - i) * w[j - 1] > max_tokens:
                break
            cost = best[i] + overhead + (j - i) * w[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    chunks, j = [], n
    while j > 0:
        chunks.append(order[cut[j]: j])
        j = cut[j]
    return chunks[::-1]
