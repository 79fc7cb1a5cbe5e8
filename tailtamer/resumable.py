"""Trainings that a stop (Ctrl-C, SIGTERM) ends between two steps: the state is saved beside
what the training writes, in a file named by what it trains from, and the same command goes
on from there to the result an uninterrupted run gives (`tailtamer sft`, `tailtamer drafter
train`, and the caches they fill). Another input's state is never read or replaced: its name
differs."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tailtamer.atomic import atomic_write, write_dir
from tailtamer.errors import WriteError
from tailtamer.stopping import Interrupted


@dataclass(frozen=True)
class Resumable:
    """The state file of a training of inputs `key` (a hash of what it trains from)."""

    path: Path
    key: str

    @classmethod
    def beside(cls, out_dir: str | Path, key: str) -> "Resumable":
        """The state of a training into `out_dir`: a sibling file named by `key`."""
        out_dir = Path(os.path.abspath(out_dir))
        return cls(out_dir.with_name(f"{out_dir.name}.partial-{key}.pt"), key)

    def save(self, state: dict) -> str:
        """Write `state` (tensors and plain values); what to tell the user of it."""
        try:
            atomic_write(self.path, lambda tmp: torch.save({**state, "key": self.key}, tmp))
        except OSError as e:
            return f"; its state could not be saved into {self.path} ({e.strerror or e})"
        return f"; saved in {self.path}: the same command goes on from there"

    def resume(self, apply: Callable[[dict], None], log: Callable[[str], None]) -> dict | None:
        """The saved state, once `apply` has loaded it; None when there is none, or when it
        cannot be read or applied (said: the training then starts over, and the caller rebuilds
        what `apply` may have half-loaded; a stop replaces the file)."""
        if not (self.path.exists() or self.path.is_symlink()):
            return None
        try:
            state = torch.load(self.path, weights_only=True)
            if state["key"] != self.key:
                raise ValueError("saved from other inputs")
            apply(state)
        except Exception as e:  # any damage
            log(f"{self.path}: cannot go on from it ({type(e).__name__}: {e}); training from the start")
            return None
        log(f"going on from step {state['step']}, saved in {self.path}")
        return state

    def write(self, out_dir: str | Path, write: Callable[[Path], None], what: str, log: Callable[[str], None],
              existing: str = "empty") -> None:
        """`write_dir(out_dir, write)` (`existing` as there), then this state removed: the
        training's result is in place. A write that fails is one line, which says where the
        state is kept when it is (the same command then writes the result from it)."""
        try:
            write_dir(Path(out_dir), write, existing=existing)
        except OSError as e:
            kept = f"; the training's state is kept in {self.path}: the same command writes it" \
                if self.path.exists() else ""
            raise WriteError(f"cannot write {what} into {out_dir} ({e.strerror or e}){kept}") from None
        self.remove(log)

    def remove(self, log: Callable[[str], None]) -> None:
        """Once what the training wrote is in place (or it diverged). Other inputs' states beside
        it are kept, and named: each may hold a model's size."""
        try:
            self.path.unlink(missing_ok=True)
        except OSError as e:
            log(f"{self.path}: the training's state, no longer needed, could not be removed ({e.strerror or e})")
        prefix = self.path.name[: self.path.name.rindex("-") + 1]
        others = sorted(p.name for p in self.path.parent.glob(f"{glob.escape(prefix)}*.pt") if p != self.path)
        if others:
            log(f"states of stopped trainings from other inputs are kept in {self.path.parent}: {', '.join(others)}; "
                f"remove those no command will go on from")


def stopped(by: str, step: int, total: int, what: str, saved: str) -> Interrupted:
    """The stop to raise after `step` of `total` steps of `what` (`saved`: `Resumable.save`'s words)."""
    return Interrupted(f"stopped by {by} after step {step} of {total} of {what}{saved}", by)

