"""Batches of the policy update: samples as (prompt + response) rows with a response mask,
split into optimizer minibatches and length-sorted micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def update_plan(response_mask: torch.Tensor, minibatches: int, micro_batch_size: int, micro_batch_tokens: int,
                max_len: int, aggregation, generator: torch.Generator, total=lambda x: x) -> list[list[MicroBatch]]:
    """Random minibatches (one optimizer step each), each cut into micro-batches of samples of
    similar length, trimmed to their longest, of at most `micro_batch_size` samples and
    `micro_batch_tokens` padded tokens: padding every sample to the step's longest response
    would waste most of the compute on long-tailed lengths (verl's dynamic batch size).

    Always exactly `minibatches` minibatches (some may be empty), so data-parallel workers
    agree on the number of optimizer steps; `total` sums the aggregation's counts over them."""
    needed = needed_width(response_mask)
    plan, key = [], 0
    for rows in torch.randperm(len(response_mask), generator=generator).tensor_split(minibatches):
        weights = aggregation(response_mask[rows], max_len, total)
        micro, part = [], []
        for i in torch.argsort(needed[rows], stable=True).tolist():
            width = int(needed[rows[i]])  # the widest so far: rows are in ascending length
            if part and (len(part) == micro_batch_size or (len(part) + 1) * width > micro_batch_tokens):
                micro.append(_micro(key, rows, part, needed, weights))
                key, part = key + 1, []
            part.append(i)
        if part:
            micro.append(_micro(key, rows, part, needed, weights))
            key += 1
        plan.append(micro)
    return plan


def _micro(key: int, rows: torch.Tensor, part: list[int], needed: torch.Tensor, weights: torch.Tensor) -> MicroBatch:
    index = torch.tensor(part)
    width = int(needed[rows[index]].max())
    return MicroBatch(key, rows[index], width, weights[index, : width - 1])


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
