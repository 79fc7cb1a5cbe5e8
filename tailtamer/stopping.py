"""Stopping a run by hand: the first Ctrl-C finishes the step, saves a checkpoint and says how
to resume; a second one stops at once (the last checkpoint stays valid: they are atomic). And
child processes that stop with their parent."""

from __future__ import annotations

import os
import signal
import threading
import time

from tailtamer.errors import TailtamerError


class Interrupted(TailtamerError):
    """The user stopped the run; the message says what was saved and how to resume."""


class StopRequest:
    """While active, SIGINT sets `requested` instead of raising; a second SIGINT raises
    KeyboardInterrupt. Only the main thread can own signal handlers: elsewhere it is inert."""

    def __init__(self, log=None):
        self.requested = False
        self.log = log
        self._previous = None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.log is not None:
            self.log("Ctrl-C: stopping after this step, with a checkpoint (Ctrl-C again to stop at once)")

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


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
