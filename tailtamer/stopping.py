"""Stopping a run: the first Ctrl-C or SIGTERM finishes the step, saves a checkpoint and says
how to resume; a second one stops at once (the last checkpoint stays valid: they are atomic).
And child processes that stop with their parent."""

from __future__ import annotations

import os
import signal
import threading
import time

from tailtamer.errors import TailtamerError


class Interrupted(TailtamerError):
    """The user stopped the run; the message says what was saved and how to resume."""


# What a user or a scheduler sends to stop a run (SLURM, Kubernetes and `docker stop` send
# SIGTERM, then SIGKILL after a grace period): both end the step and save a checkpoint.
STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class StopRequest:
    """While active, SIGINT and SIGTERM set `requested` (and `by`, the signal's name) instead of
    ending the process; a second one raises KeyboardInterrupt. `on_request(signum)` is called on
    the first (the launcher passes a SIGTERM on to its workers). Only the main thread can own
    signal handlers: elsewhere it is inert."""

    def __init__(self, log=None, on_request=None):
        self.requested = False
        self.by: str | None = None
        self.log, self.on_request = log, on_request
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.by = True, STOP_SIGNALS[signum]
        if self.on_request is not None:
            self.on_request(signum)
        if self.log is not None:
            self.log(f"{self.by}: stopping after this step, with a checkpoint (send it again to stop at once)")

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def exit_with_parent() -> None:
    """End this process as soon as its parent is gone (e.g. killed with SIGKILL): an orphaned
    worker would go on writing into the run directory, and an orphaned reward process stuck in
    a loop would never end."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
