"""The policy's optimizer (AdamW) and its learning-rate schedules (rl.lr_schedule)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from tailtamer.adamw import adamw


def constant(progress: float, min_ratio: float) -> float:
    """lr(p) = lr: the schedule of most GRPO recipes (verl's and TRL's GRPO defaults)."""
    return 1.0


def linear(progress: float, min_ratio: float) -> float:
    """lr(p) = lr · (1 − (1 − r)·p), from lr to r·lr over the run (TRL's default for SFT)."""
    return 1.0 - (1.0 - min_ratio) * progress


def cosine(progress: float, min_ratio: float) -> float:
    """lr(p) = lr · (r + (1 − r)·(1 + cos πp)/2) (Loshchilov & Hutter 2017, without restarts;
    verl's `cosine` with min_lr_ratio r)."""
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


LR_SCHEDULES: dict[str, Callable[[float, float], float]] = {"constant": constant, "linear": linear, "cosine": cosine}


def lr_factor(schedule: str, step: int, warmup: int, total: int, min_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based) of `total`:
    linear warm-up (step + 1)/warmup for the first `warmup` steps, then the schedule at
    progress p = (step − warmup)/(total − warmup), clamped to [0, 1]."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    return LR_SCHEDULES[schedule](progress, min_ratio)


def make_optimizer(model: torch.nn.Module, rl, total_rl_steps: int):
    """AdamW over the policy with rl.lr_schedule; warm-up and the schedule count optimizer
    steps (rl.minibatches × rl.ppo_epochs per RL step)."""
    per_step = rl.minibatches * rl.ppo_epochs
    optimizer = adamw(model.parameters(), lr=rl.lr, betas=(rl.adam_beta1, rl.adam_beta2),
                      eps=rl.adam_eps, weight_decay=rl.weight_decay)
    warmup, total = rl.warmup * per_step, total_rl_steps * per_step
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: lr_factor(rl.lr_schedule, k, warmup, total, rl.min_lr_ratio))
    return optimizer, scheduler
