"""Batches of the policy update: samples as (prompt + response) rows with a response mask,
split into optimizer minibatches and length-sorted micro-batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tailtamer.token_budget import token_budget_chunks


@dataclass
class Samples:
    """One step's samples on this worker, a row each.

    mask[b, t] marks position t whose next token is a response token (every one); `keep`
    says whether the sample counts in the policy loss (dynamic
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


@dataclass
class Minibatch:
    """One optimizer step's micro-batches, and the aggregation weight of the loss tokens that
    no micro-batch computes (samples whose gradient is exactly zero): they still count in the
    step's totals (the clip fraction's denominator, whether any token counts at all)."""

    micro: list[MicroBatch]
    uncomputed_weight: float = 0.0

    def __iter__(self):
        return iter(self.micro)

    def __len__(self) -> int:
        return len(self.micro)


def needed_width(response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) tokens each sample needs: ids[:, :w] holds its prompt and every counted response
    token (2 for a sample with none, which then costs almost nothing)."""
    needed = response_mask.shape[1] - response_mask.flip(1).int().argmax(1) + 1
    needed[~response_mask.any(1)] = 2
    return needed


def minibatch_of(index: torch.Tensor, n_total: int, minibatches: int, generator: torch.Generator) -> torch.Tensor:
    """Minibatch of each global sample index: a random permutation of all `n_total` samples of
    the step cut into `minibatches` parts (sizes differ by at most one). It depends on the
    step's samples only, so N workers form the same minibatches as one."""
    order = torch.randperm(n_total, generator=generator)
    part = torch.empty(n_total, dtype=torch.long)
    for j, chunk in enumerate(order.tensor_split(minibatches)):
        part[chunk] = j
    return part[index]


def computed_mask(samples: Samples, skip_zero_advantage: bool) -> torch.Tensor:
    """The loss tokens a forward+backward must compute: every one, or with
    `skip_zero_advantage` none of a sample whose advantage is exactly 0. Its policy-loss
    gradient is exactly 0 (PPO-clip and GSPO: -min(r·A, clip(r)·A) = 0 for every finite
    ratio r), so skipping it changes no gradient, as long as the loss has no term without A
    (KL, entropy)."""
    loss_mask = samples.loss_mask
    return loss_mask & (samples.advantages != 0)[:, None] if skip_zero_advantage else loss_mask


def update_plan(samples: Samples, n_total: int, minibatches: int, micro_batch_size: int, micro_batch_tokens: int,
                max_len: int, aggregation, generator: torch.Generator, total=lambda x: x,
                skip_zero_advantage: bool = False) -> list[Minibatch]:
    """Random minibatches (one optimizer step each), each cut into `token_budget_chunks`
    micro-batches trimmed to their longest sample.

    Always exactly `minibatches` minibatches (some may be empty), so data-parallel workers
    agree on the number of optimizer steps; `total` sums the aggregation's counts over them.
    The aggregation weights are those of every loss token; with `skip_zero_advantage` the
    samples of advantage 0 are in no micro-batch (`computed_mask`), their weight is the
    minibatch's `uncomputed_weight`, and the gradient is the same."""
    loss_mask = samples.loss_mask
    computed = computed_mask(samples, skip_zero_advantage)
    needed = needed_width(computed)
    part = minibatch_of(samples.index, n_total, minibatches, generator)
    plan, key = [], 0
    for j in range(minibatches):
        rows = (part == j).nonzero().flatten()
        weights = aggregation(loss_mask[rows], max_len, total)
        live = computed[rows].any(1)
        micro = []
        for chunk in token_budget_chunks(needed[rows[live]].tolist(), micro_batch_size, micro_batch_tokens):
            index = live.nonzero().flatten()[chunk]
            width = int(needed[rows[index]].max())
            micro.append(MicroBatch(key, rows[index], width, weights[index, : width - 1]))
            key += 1
        plan.append(Minibatch(micro, float(weights[~live].sum())))
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


def balanced_shares_by_group(costs: list[float], groups: list[int], workers: int) -> list[list[int]]:
    """`balanced_shares` inside each group (a minibatch): every optimizer step ends in a
    gradient all-reduce, so each minibatch's work, not just the step's, must be even across
    workers, or the lighter ones wait at every step. Sorted indices per worker."""
    shares: list[list[int]] = [[] for _ in range(workers)]
    for g in sorted(set(groups)):
        members = [i for i, x in enumerate(groups) if x == g]
        for share, part in zip(shares, balanced_shares([costs[i] for i in members], workers)):
            share += [members[j] for j in part]
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


def rebalance(workers, samples: Samples, pad_id: int, group_of: Callable[[torch.Tensor], torch.Tensor],
              skip_zero_advantage: bool = False) -> Samples:
    """Re-deal the step's samples for the update so every worker gets about as many tokens
    of the policy loss in each minibatch (`balanced_shares_by_group`, the minibatch of a
    sample given by `group_of` its global index): each worker rolled out its own prompts,
    and on long-tailed lengths one of them would otherwise hold the longest responses and
    keep the rest waiting at every gradient all-reduce (verl's balance_batch, per optimizer
    step). A sample no forward computes (dropped by the loss, or of advantage 0 with
    `skip_zero_advantage`: `batching.computed_mask`) costs nothing. Rows travel trimmed to
    what they need."""
    if workers.world == 1:
        return samples
    s = samples
    needed = needed_width(s.mask).tolist()
    # Plain lists travel: pickling a tensor per row costs ~0.1 s per step for 64 rows.
    mine = list(zip([s.ids[i, :n].tolist() for i, n in enumerate(needed)],
                    [s.mask[i, : n - 1].tolist() for i, n in enumerate(needed)],
                    s.keep.tolist(), s.advantages.tolist(), s.index.tolist(),
                    computed_mask(s, skip_zero_advantage).any(1).tolist()))
    rows = [row for part in workers.gather(mine) for row in part]
    costs = [len(r[0]) if r[5] else 0 for r in rows]
    groups = group_of(torch.tensor([r[4] for r in rows])).tolist()
    share = balanced_shares_by_group(costs, groups, workers.world)[workers.rank]
    width = max([len(rows[i][0]) for i in share] + [2])
    ids = torch.full((len(share), width), pad_id, dtype=s.ids.dtype)
    mask = torch.zeros(len(share), width - 1, dtype=torch.bool)
    for j, i in enumerate(share):
        ids[j, : len(rows[i][0])] = torch.tensor(rows[i][0], dtype=s.ids.dtype)
        mask[j, : len(rows[i][1])] = torch.tensor(rows[i][1], dtype=torch.bool)
    column = lambda k, dtype: torch.tensor([rows[i][k] for i in share], dtype=dtype)  # noqa: E731
    return Samples(ids, mask, column(2, torch.bool), column(3, s.advantages.dtype), column(4, torch.long))
