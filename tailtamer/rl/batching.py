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


def update_plan(response_mask: torch.Tensor, minibatches: int, micro_batch_size: int, max_len: int,
                aggregation, generator: torch.Generator, total=lambda x: x) -> list[list[MicroBatch]]:
    """Random minibatches (one optimizer step each), each cut into micro-batches of samples of
    similar length trimmed to their longest: padding every sample to the step's longest
    response would waste most of the compute on long-tailed lengths.

    Always exactly `minibatches` minibatches (some may be empty), so data-parallel workers
    agree on the number of optimizer steps; `total` sums the aggregation's counts over them."""
    needed = response_mask.shape[1] - response_mask.flip(1).int().argmax(1) + 1
    needed[~response_mask.any(1)] = 2
    plan, key = [], 0
    for rows in torch.randperm(len(response_mask), generator=generator).tensor_split(minibatches):
        weights = aggregation(response_mask[rows], max_len, total)
        rows_by_len = torch.argsort(needed[rows], stable=True)
        micro = []
        for part in rows_by_len.split(micro_batch_size):
            width = int(needed[rows[part]].max())
            micro.append(MicroBatch(key, rows[part], width, weights[part, : width - 1]))
            key += 1
        plan.append(micro)
    return plan


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
