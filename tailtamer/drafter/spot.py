"""Spot trainer: drafter training in time the rollout leaves idle, preemptible within a step.

A worker whose rollout shard is done trains the drafter on the DataBuffer until it is told to
stop; it checks the stop signal before every drafter step's forward and its backward, so it is
preempted within about half a step and never delays the policy update. Each step packs
buffer samples into one row (no padding, no cross-sample attention) and applies the warm-up's
EAGLE loss. A selective asynchronous checkpoint copies only the drafter's own tensors (never
the shared embedding / LM head) and writes them from a background thread (TLT §2.2).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tailtamer.config_fields import at_least, f, positive
from tailtamer.drafter.buffer import DataBuffer, pairs
from tailtamer.drafter.train import check_unroll, pack, unrolled_loss
from tailtamer.errors import ConfigError, WriteError
from tailtamer.model.drafter import Drafter, drafter_tensors, write_drafter
from tailtamer.adamw import adamw


@dataclass(frozen=True)
class SpotConfig:
    train: bool = f(True, "train the EAGLE drafter online (needs spec.drafter = an EAGLE drafter directory)")
    single_worker: str = f("never", "with one worker: never, or window (train for window_s after each update, "
                                    "which lengthens every step: one worker has no idle time)")
    window_s: float = f(2.0, "single worker, window: seconds of drafter training after each update")
    max_steps: int = f(200, "drafter steps per RL step at most")
    lr: float = f(5e-4, "AdamW learning rate of the drafter")
    tokens_per_step: int = f(256, "packed tokens per drafter step (a step is the preemption latency: ~10 ms on "
                                  "a CPU core with unroll 2, as 512 took with unroll 1); a longer response gives a "
                                  "random window of this many")
    buffer_mb: int = f(256, "DataBuffer budget (MiB); the oldest entries are dropped beyond it")
    long_quantile: float = f(0.5, "one-step offset: previous-step responses at least this length quantile")
    compare_frozen: bool = f(True, "also score the warm-up drafter on each step's fresh data (in idle time)")
    unroll: int = f(2, "drafting levels trained per pair, the later ones on the drafter's own features (as the "
                       "warm-up's unroll, so online training keeps what it taught the deeper levels)")

    def trains(self, eagle: bool, world: int) -> bool:
        """Whether an EAGLE drafter (`eagle`) trains online with `world` workers: one worker has
        no idle time to train in, unless single_worker=window gives it some."""
        return eagle and self.train and (world > 1 or self.single_worker == "window")

    def __post_init__(self):
        if self.single_worker not in ("never", "window"):
            raise ConfigError(f"spot.single_worker must be never or window, got {self.single_worker!r}")
        positive(self, "spot", "lr")
        if not 0 <= self.long_quantile < 1:
            raise ConfigError(f"spot.long_quantile must be in [0, 1), got {self.long_quantile}")
        at_least(self, "spot", 0, "window_s")
        at_least(self, "spot", 1, "tokens_per_step", "buffer_mb", "unroll")
        check_unroll(self.unroll, "spot.unroll")
        at_least(self, "spot", 0, "max_steps")


class SpotTrainer:
    def __init__(self, drafter: Drafter, buffer: DataBuffer, cfg: SpotConfig, seed: int = 0):
        self.drafter = drafter
        self.buffer = buffer
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.optimizer = adamw(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
        self.steps = 0
        self._writer: threading.Thread | None = None
        self._write_error: WriteError | None = None  # of the last background checkpoint

    def train(self, should_stop: Callable[[], bool], deadline: float | None = None) -> dict:
        """Drafter steps until `should_stop()` (checked before every step's forward and its
        backward), `deadline` (perf_counter seconds), `max_steps` or an empty buffer. Returns
        steps, seconds, mean loss and the seconds from the stop signal to the return (0 when
        it ended otherwise)."""
        t0 = time.perf_counter()
        losses, stopped_at = [], None
        while len(losses) < self.cfg.max_steps and len(self.buffer):
            if deadline is not None and time.perf_counter() >= deadline:
                break
            loss = self.step(should_stop)
            if loss is None:
                stopped_at = time.perf_counter()
                break
            losses.append(loss)
        end = time.perf_counter()
        return {"steps": len(losses), "seconds": end - t0,
                "loss": sum(losses) / len(losses) if losses else None,
                "preempt_latency_s": end - stopped_at if stopped_at is not None else 0.0}

    def step(self, should_stop: Callable[[], bool] = lambda: False) -> float | None:
        """One drafter step on a packed buffer sample; None, with the drafter and its optimizer
        untouched, when `should_stop()` is true before the forward or before the backward. The
        backward is half the step, so the second check halves how long a stop waits for it."""
        if should_stop():
            return None
        entries = self.buffer.sample(self.rng, self.cfg.tokens_per_step, self.cfg.long_quantile)
        tokens, h_in, h_next, mask, positions, attn = pack([pairs(e) for e in entries])
        dtype = self.drafter.fc.weight.dtype
        target = self.drafter.target
        flags = [p.requires_grad for p in target.parameters()]
        target.requires_grad_(False)  # gradients reach the drafter only, never the policy
        try:
            with torch.no_grad():
                target_logits = target.lm_head(h_next.to(dtype))
            loss, _, _, _ = unrolled_loss(self.drafter, tokens, h_in.to(dtype), h_next.to(dtype), target_logits, mask,
                                          positions, attn, self.cfg.unroll)
            if should_stop():
                return None
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        finally:
            for p, flag in zip(target.parameters(), flags):
                p.requires_grad_(flag)
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        self.optimizer.step()
        self.steps += 1
        return loss.item()

    def checkpoint_async(self, out_dir: Path) -> threading.Thread:
        """Selective asynchronous checkpoint: copy the drafter's own tensors now (the only
        time training waits), write them in a background thread. One write at a time."""
        self.wait()
        tensors = drafter_tensors(self.drafter)

        def write() -> None:
            try:
                write_drafter(tensors, self.drafter.config, out_dir)
            except OSError as e:  # raised by the next wait(), in the training thread
                self._write_error = WriteError(f"cannot write the drafter into {out_dir} ({e.strerror or e})")

        self._writer = threading.Thread(target=write, daemon=True)
        self._writer.start()
        return self._writer

    def wait(self) -> None:
        """Wait for the checkpoint being written; a write it could not make is raised here."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        error, self._write_error = self._write_error, None
        if error is not None:
            raise error
