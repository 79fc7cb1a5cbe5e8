"""The adaptive drafter's part of the RL step (TLT §2.2), in one object.

  collector(step)                    what the rollout engine calls as each response finishes
                                     (`Engine.generate(keep_hidden=...)`): the hidden states
                                     its own forwards computed go into the DataBuffer, so no
                                     forward runs for the drafter's data (fastrl takes them from
                                     SGLang's rollout too, `return_hidden_states`);
  add_sequences(step, ...)           the same from the update's forward, for a backend whose
                                     rollout keeps no hidden states (vLLM);
  train_while_idle(should_stop)      on a worker whose rollout shard is done: score the drafter
                                     (and a frozen copy of the warm-up drafter) on the newest
                                     responses neither has trained on, then spot-train until
                                     `should_stop()` (checked before each drafter step's
                                     forward and its backward, and between the scores' forwards);
  publish(steps)                     average the workers' drafters, weighted by the steps each
                                     took, so every engine drafts with the same one next step
                                     (started once every worker's training is over, finished
                                     after the update).
Everything else the drafter costs the step is a copy into the buffer and that average: the
scoring and the training happen in time the rollout leaves idle.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from tailtamer.drafter.buffer import DataBuffer
from tailtamer.drafter.estimate import estimate_accept_length
from tailtamer.drafter.spot import SpotConfig, SpotTrainer
from tailtamer.model.drafter import Drafter, save_drafter
from tailtamer.rollout.sampling import SamplingParams


class AdaptiveDrafter:
    trains = True

    def __init__(self, drafter: Drafter, cfg: SpotConfig, workers, seed: int, depth: int,
                 params: SamplingParams, frozen: Drafter | None = None):
        self.drafter, self.cfg, self.workers = drafter, cfg, workers
        self.buffer = DataBuffer(cfg.buffer_mb << 20)
        self.trainer = SpotTrainer(drafter, self.buffer, cfg, seed)
        self.frozen = frozen
        self.depth, self.params = depth, params

    def collector(self, step: int) -> Callable[[list[int], int, torch.Tensor], None]:
        """`keep_hidden` for the rollout of RL step `step`."""
        return lambda tokens, response_start, hidden: self.buffer.add_response(step, tokens, response_start, hidden)

    def add_sequences(self, step: int, ids: torch.Tensor, response_mask: torch.Tensor, hidden: torch.Tensor) -> None:
        """Sequences a target forward ran (the update's, where the rollout engine keeps no hidden
        states): ids (B, W), response_mask (B, W − 1) true where ids[:, t + 1] is a response
        token, hidden (B, W, H) the final hidden states. Each goes into the buffer whole (its
        last token consumed too), as a finished request's would."""
        starts = response_mask.int().argmax(1)
        ends = response_mask.shape[1] - response_mask.flip(1).int().argmax(1)
        for row, (has, start, end) in enumerate(zip(response_mask.any(1).tolist(), starts.tolist(), ends.tolist())):
            if has:
                self.buffer.add_response(step, ids[row, : end + 1].tolist(), start + 1, hidden[row, : end + 1])

    def train_while_idle(self, should_stop: Callable[[], bool], deadline: float | None = None) -> dict:
        """Score on the newest buffered step (only if there is time: it is a metric), then
        spot-train. Returns the trainer's report with `accept_est` / `accept_est_frozen` as
        (value, weight) pairs (weight 0: not scored)."""
        report = {"accept_est": (1.0, 0.0), "accept_est_frozen": (1.0, 0.0)}
        fresh = self.buffer.newest()
        if fresh:
            report["accept_est"] = estimate_accept_length(self.drafter, fresh, self.depth, self.params, budget=1024,
                                                          should_stop=should_stop)
            if self.frozen is not None:
                report["accept_est_frozen"] = estimate_accept_length(self.frozen, fresh, self.depth, self.params,
                                                                     budget=1024, should_stop=should_stop)
        return {**report, **self.trainer.train(should_stop, deadline)}

    def train_in_window(self) -> dict:
        """One worker has no idle time: train for `spot.window_s` after the update instead."""
        return self.train_while_idle(lambda: False, deadline=time.perf_counter() + self.cfg.window_s)

    @property
    def dropped(self) -> int:
        """Buffer entries evicted so far to stay within spot.buffer_mb."""
        return self.buffer.dropped

    def publish(self, steps: int) -> Callable[[], None]:
        """Start averaging the workers' drafters (`Workers.start_average`); the returned call
        finishes it, so the transfer overlaps the update."""
        return self.workers.start_average(self.drafter, steps)

    def publish_to(self, backend) -> None:
        """The averaged drafter into the rollout engine (our engine runs this very module)."""
        backend.publish_drafter(self.drafter)

    def save(self, out_dir) -> None:
        save_drafter(self.drafter, out_dir)

    def checkpoint_async(self, out_dir) -> None:
        self.trainer.checkpoint_async(out_dir)

    def wait(self) -> None:
        self.trainer.wait()


class NoDrafter:
    """The adaptive drafter's part of the RL step where no drafter is trained (speculation off,
    the n-gram drafter, spot.train=false, or one worker without a training window): every call
    does nothing, so the RL step reads the same either way."""

    trains = False
    drafter = frozen = None
    dropped = 0

    def collector(self, step: int) -> None:
        return None

    def add_sequences(self, step: int, ids, response_mask, hidden) -> None:
        pass

    def train_while_idle(self, should_stop: Callable[[], bool], deadline: float | None = None) -> None:
        return None

    def train_in_window(self) -> None:
        return None

    def publish(self, steps: int) -> Callable[[], None]:
        return lambda: None

    def publish_to(self, backend) -> None:
        pass

    def save(self, out_dir) -> None:
        pass

    def checkpoint_async(self, out_dir) -> None:
        pass

    def wait(self) -> None:
        pass
