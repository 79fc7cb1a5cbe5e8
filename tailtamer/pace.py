"""Runs that take turns step by step, for `tailtamer bench train`.

Two arms of a benchmark run one after the other, whole run after whole run, are seconds to
minutes apart, and on a shared VM the machine's speed drifts over that much (SD off alone
took 1.58-2.26 s per step across runs of one day). Run side by side, the arms would compete
for the cores. Taking turns step by step does neither: arm a runs step i only when the turn
counter reads i * arms + a, so the same step of every arm runs within seconds, alone.

The benchmark starts each arm as its own training process (`python -m tailtamer.bench_train
DIR:ARM:ARMS key=value ...`) and hands the trainer a `Pace`, which its workers get too; DIR
holds the counter (`turn`) and a `ready-ARM` file per arm whose set-up is done. An ordinary
run has `NoPace`, which never waits.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

POLL_S = 0.02  # a turn starts within this of the last one ending; polling costs ~0.3% of a core
# The first step waits this long after the last arm is set up: without it, whatever the set-ups
# leave behind slowed the first steps (the second arm's by 0.3-0.5 s of a 0.5-0.9 s step on the
# 2-core VM, 2026-12-05; with a 3 s pause both arms' first steps ran like their later ones).
SETTLE_S = 3.0


def turn_of(step: int, arm: int, arms: int) -> int:
    """The counter value at which `arm` may run `step` (0-based): steps alternate arm by arm."""
    return step * arms + arm


class NoPace:
    """What an ordinary run's steps wait for: nothing."""

    paced = False

    def ready(self) -> None:
        pass

    def wait(self, step: int) -> None:
        pass

    def done(self, step: int, settle: Callable[[], None] = lambda: None) -> None:
        pass

    def finish(self, steps: int) -> None:
        pass


class Pace(NoPace):
    paced = True

    def __init__(self, spec: str):
        where, arm, arms = spec.rsplit(":", 2)
        self.dir, self.arm, self.arms = Path(where), int(arm), int(arms)

    def _turn(self) -> int:
        try:
            return int((self.dir / "turn").read_text())
        except (OSError, ValueError):  # mid-replace on some filesystems: read again
            return -1

    def _wait(self, ok) -> None:
        while not ok():
            time.sleep(POLL_S)

    def ready(self) -> None:
        """This arm's set-up is done (worker 0 says so)."""
        (self.dir / f"ready-{self.arm}").touch()

    def wait(self, step: int) -> None:
        """Block until every arm is set up (and has settled, before the first step) and it is
        this arm's turn to run `step`."""
        self._wait(lambda: all((self.dir / f"ready-{a}").exists() for a in range(self.arms)))
        if step == 0:
            time.sleep(SETTLE_S)
        self._wait(lambda: self._turn() == turn_of(step, self.arm, self.arms))

    def done(self, step: int, settle: Callable[[], None] = lambda: None) -> None:
        """`step` is over, once `settle()` returns (its background writes): the next arm's turn
        (worker 0 says so)."""
        settle()
        tmp = self.dir / f".turn-{self.arm}"
        tmp.write_text(str(turn_of(step, self.arm, self.arms) + 1))
        os.replace(tmp, self.dir / "turn")

    def finish(self, steps: int) -> None:
        """Wait for every arm's last step, so no arm's wrapping up (plots) overlaps a step."""
        self._wait(lambda: self._turn() >= steps * self.arms)
