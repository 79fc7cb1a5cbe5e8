"""Batches of the policy update: samples as (prompt + response) rows with a response mask,
split into optimizer minibatches and length-sorted micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Samples:
    """One step's samples on this worker, a row each.

    mask[b, t] marks position t whose next token is a response token (every one: what the
    drafter learns from); `keep` says whether the sample counts in the policy loss (dynamic
    sampling and overlong masking drop some); `index` is the sample's global index in the
    step (prompt-major), which fixes its minibatch whatever worker holds it."""

    ids: torch.Tensor  # (B, T) long
    mask: torch.Tensor  # (B, T - 1) bool
    keep: torch.Tensor  # (B,) bool
    advantages: torch.Tensor  # (B,)
    index: torch.Tensor  # (B,) long

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.mask & self.keep[:, None]


@dataclass
class MicroBatch:
    key: int
    rows: torch.Tensor  # sample indices
    width: int  # ids[:, :width] holds every token these samples need
    weights: torch.Tensor  # (len(rows), width - 1) aggregation weights of their response tokens


def needed_width(response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) tokens each sample needs: ids[:, :w] holds its prompt and every counted response
    token (2 for a sample with none, which then costs almost nothing)."""
    needed = response_mask.shape[1] - response_mask.flip(1).int().argmax(1) + 1
    needed[~response_mask.any(1)] = 2
    return needed


def token_budget_chunks(widths: list[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Indices of `widths` in ascending width, cut into chunks of at most `max_rows` rows and
    `max_rows x width` <= `max_tokens` padded tokens (a row wider than the budget goes alone):
    padding every sample to the longest would waste most of the compute on long-tailed
    lengths (verl's dynamic batch size)."""
    chunks, part = [], []
    for i in sorted(range(len(widths)), key=lambda i: (widths[i], i)):
        if part and (len(part) == max_rows or (len(part) + 1) * widths[i] > max_tokens):
            chunks.append(part)
            part = []
        part.append(i)
    return chunks + [part] if part else chunks


def minibatch_of(index: torch.Tensor, n_total: int, minibatches: int, generator: torch.Generator) -> torch.Tensor:
    """Minibatch of each global sample index: a random permutation of all `n_total` samples of
    the step cut into `minibatches` parts (sizes differ by at most one). It depends on the
    step's samples only, so N workers form the same minibatches as one."""
    order = torch.randperm(n_total, generator=generator)
    part = torch.empty(n_total, dtype=torch.long)
    for j, chunk in enumerate(order.tensor_split(minibatches)):
        part[chunk] = j
    return part[index]


def update_plan(samples: Samples, n_total: int, minibatches: int, micro_batch_size: int, micro_batch_tokens: int,
                max_len: int, aggregation, generator: torch.Generator, total=lambda x: x) -> list[list[MicroBatch]]:
    """Random minibatches (one optimizer step each), each cut into `token_budget_chunks`
    micro-batches trimmed to their longest sample.

    Always exactly `minibatches` minibatches (some may be empty), so data-parallel workers
    agree on the number of optimizer steps; `total` sums the aggregation's counts over them."""
    loss_mask = samples.loss_mask
    needed = needed_width(loss_mask)
    part = minibatch_of(samples.index, n_total, minibatches, generator)
    plan, key = [], 0
    for j in range(minibatches):
        rows = (part == j).nonzero().flatten()
        weights = aggregation(loss_mask[rows], max_len, total)
        micro = []
        for chunk in token_budget_chunks(needed[rows].tolist(), micro_batch_size, micro_batch_tokens):
            index = torch.tensor(chunk, dtype=torch.long)
            width = int(needed[rows[index]].max())
            micro.append(MicroBatch(key, rows[index], width, weights[index, : width - 1]))
            key += 1
        plan.append(micro)
    return plan


def balanced_shares(costs: list[float], workers: int) -> list[list[int]]:
    """Deal items out to `workers` so their summed costs are close: longest-processing-time
    first, each item to the least-loaded worker (Graham 1969: the largest load is at most
    4/3 of the optimum). Deterministic: ties go to the lower worker and the earlier item."""
    shares: list[list[int]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        w = min(range(workers), key=lambda w: (loads[w], w))
        shares[w].append(i)
        loads[w] += costs[i]
    return [sorted(share) for share in shares]


def response_batch(batch, completions, pad_id: int):
    """(ids, mask) with ids = prompt + response per sample, right-padded; mask[b, t] marks
    position t whose next token (ids[b, t + 1]) is a response token, aligned with
    token_log_probs(logits[:, :-1], ids[:, 1:])."""
    seqs = [batch[c.prompt_index]["prompt_ids"] + c.token_ids for c in completions]
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
    for i, (seq, c) in enumerate(zip(seqs, completions)):
        ids[i, : len(seq)] = torch.tensor(seq)
        prompt = len(seq) - len(c.token_ids)
        mask[i, prompt - 1: len(seq) - 1] = True
    return ids, mask
