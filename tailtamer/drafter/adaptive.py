"""The adaptive drafter's part of the RL step (TLT §2.2), in one object.

  observe(step, ids, hidden, mask)   the update forward's hidden states go into the
                                     DataBuffer (no extra forward);
  defer(step, ids, mask)             responses no forward of the update computes (the policy
                                     loss skips or drops them) wait for idle time;
  train_while_idle(should_stop)      on a worker whose rollout shard is done: first the deferred
                                     responses' hidden states, then score the drafter (and a
                                     frozen copy of the warm-up drafter) on the newest responses
                                     neither has trained on, then spot-train until
                                     `should_stop()` (checked before every forward and step);
  publish(steps)                     average the workers' drafters, weighted by the steps each
                                     took, so every engine drafts with the same one next step.
Everything else the drafter costs the step is a copy into the buffer and that average: the
deferred forwards, the scoring and the training happen in time the rollout leaves idle.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from tailtamer.device import autocast
from tailtamer.drafter.buffer import DataBuffer
from tailtamer.drafter.estimate import estimate_accept_length
from tailtamer.drafter.spot import SpotConfig, SpotTrainer
from tailtamer.model.drafter import Drafter, save_drafter
from tailtamer.rl.batching import needed_width, token_budget_chunks
from tailtamer.rollout.sampling import SamplingParams


class AdaptiveDrafter:
    def __init__(self, drafter: Drafter, cfg: SpotConfig, workers, seed: int, depth: int,
                 params: SamplingParams, frozen: Drafter | None = None, dtype: torch.dtype = torch.float32):
        self.drafter, self.cfg, self.workers = drafter, cfg, workers
        self.buffer = DataBuffer(cfg.buffer_mb << 20)
        self.trainer = SpotTrainer(drafter, self.buffer, cfg, seed)
        self.frozen = frozen
        self.depth, self.params, self.dtype = depth, params, dtype
        self.pending: tuple[int, torch.Tensor, torch.Tensor, float] | None = None

    def observe(self, step: int, ids: torch.Tensor, hidden: torch.Tensor, response_mask: torch.Tensor) -> None:
        self.buffer.add_batch(step, ids, hidden, response_mask)

    def defer(self, step: int, ids: torch.Tensor, response_mask: torch.Tensor, start: float = 0.0) -> None:
        """Responses (B, T) whose hidden states no forward of the update gave: the next idle
        time computes them, beginning `start` of the way through them (workers given the same
        responses begin at different places). Only the newest step's wait: responses of an
        older step still waiting (no idle time since) are dropped, counted in buffer.dropped."""
        if self.pending is not None:
            self.buffer.dropped += len(self.pending[1])
        self.pending = (step, ids, response_mask, start) if len(ids) else None

    def _deferred_features(self, should_stop: Callable[[], bool], deadline: float | None) -> None:
        """The deferred responses' hidden states into the buffer: one no-grad forward of the
        target per chunk of about spot.tokens_per_step tokens (about a drafter step's time, so
        preemption waits no longer than it does for a step); what a stop leaves stays deferred."""
        step, ids, mask, start = self.pending
        widths = needed_width(mask).tolist()
        chunks = token_budget_chunks(widths, len(widths), self.cfg.tokens_per_step)
        first = int(start * len(chunks))
        chunks = chunks[first:] + chunks[:first]
        target = self.drafter.target
        for n, chunk in enumerate(chunks):
            if should_stop() or (deadline is not None and time.perf_counter() >= deadline):
                rest = torch.tensor([i for c in chunks[n:] for i in c])
                self.pending = (step, ids[rest], mask[rest], 0.0)
                return
            width = max(widths[i] for i in chunk)
            rows = ids[chunk, :width].to(target.device)
            with torch.no_grad(), autocast(target.device, self.dtype):
                hidden = target.hidden_states(rows)
            self.buffer.add_batch(step, rows, hidden, mask[chunk, : width - 1])
        self.pending = None

    def train_while_idle(self, should_stop: Callable[[], bool], deadline: float | None = None) -> dict:
        """The deferred responses' hidden states, a score on the newest buffered step (only if
        there is time: it is a metric), then spot training. Returns the trainer's report with
        `accept_est` / `accept_est_frozen` as (value, weight) pairs (weight 0: not scored)."""
        report = {"accept_est": (1.0, 0.0), "accept_est_frozen": (1.0, 0.0)}
        if self.pending is not None:
            self._deferred_features(should_stop, deadline)
        fresh = self.buffer.newest()
        if fresh and not should_stop():
            report["accept_est"] = estimate_accept_length(self.drafter, fresh, self.depth, self.params, budget=1024)
            if self.frozen is not None:
                report["accept_est_frozen"] = estimate_accept_length(self.frozen, fresh, self.depth, self.params,
                                                                     budget=1024)
        return {**report, **self.trainer.train(should_stop, deadline)}

    def train_in_window(self) -> dict:
        """One worker has no idle time: train for `spot.window_s` after the update instead."""
        return self.train_while_idle(lambda: False, deadline=time.perf_counter() + self.cfg.window_s)

    def publish(self, steps: int) -> None:
        self.workers.average_(self.drafter, steps)

    def save(self, out_dir) -> None:
        save_drafter(self.drafter, out_dir)

    def checkpoint_async(self, out_dir) -> None:
        self.trainer.checkpoint_async(out_dir)

    def wait(self) -> None:
        self.trainer.wait()
