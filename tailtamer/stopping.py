"""Stopping a run: the first Ctrl-C, or a SIGTERM (what SLURM, Kubernetes and `docker stop`
send before they kill), finishes the step, saves a checkpoint and says how to resume; a second
Ctrl-C stops at once (the last checkpoint stays valid: they are atomic). And child processes
that stop with their parent, and a command whose output's reader has gone (`| head`)."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable

from tailtamer.errors import TailtamerError

SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
# What a StopRequest says when it first hears a stop (a benchmark waits for it in a run's log)
STOPPING = "stopping after this step, with a checkpoint"


# What a training says when the reader of its output has gone (its own process or a worker's)
CLOSED_PIPE = "the reader of its output has ended (a closed pipe)"


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (`| head` read what it wanted: the pipe
    polls as an error), so a BrokenPipeError is the reader's doing, not another pipe's. If so
    stdout is pointed at /dev/null, so that the interpreter's exit does not fail flushing it."""
    if sys.stdout is None:
        return False
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        # Linux polls a pipe without its reader as an error, macOS as hung up
        closed = any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except AttributeError:  # no poll (Windows): a broken pipe there is taken to be stdout's
        closed = True
    except (OSError, ValueError):  # stdout is not a file
        return False
    if closed:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return closed


class Interrupted(TailtamerError):
    """The user stopped the run; the message says what was saved and how to resume. `by`: the
    signal that asked ("Ctrl-C", "SIGTERM"), where the message begins "stopped by `by`", so a
    launcher that received the signal itself can name it for its workers (it passes a Ctrl-C on
    to them as SIGTERM)."""

    def __init__(self, message: str, by: str | None = None):
        super().__init__(message)
        self.by = by

    def stopped_by(self, by: str) -> "Interrupted":
        """This stop, said to be `by`'s."""
        if self.by is None or by == self.by:
            return self
        return Interrupted(f"stopped by {by}" + str(self).removeprefix(f"stopped by {self.by}"), by)


class Terminated(KeyboardInterrupt):
    """A SIGTERM where no StopRequest holds it: stop at once, as a Ctrl-C does there."""


@contextmanager
def sigterm_stops_at_once():
    """Within the block, SIGTERM raises Terminated in the main thread, so the command unwinds as
    after a Ctrl-C (temporary directories removed, an empty --out too) instead of ending where it
    stands, as Python's default does. A StopRequest inside takes SIGTERM over while it is active."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class StopRequest:
    """While active, SIGINT and SIGTERM set `requested` (and `reason`: what asked) instead of
    ending the process. A second SIGINT raises KeyboardInterrupt: stop at once. SIGTERM never
    escalates: sent to a whole process group it reaches a worker twice (directly and passed on
    by the launcher), and the schedulers that send it follow with SIGKILL when they stop
    waiting. `on_term` runs on each SIGTERM and on the first SIGINT: the launcher passes a stop
    on to its workers as SIGTERM, so a Ctrl-C sent to the launcher alone (`kill -INT PID`)
    stops them too, and one sent to the whole group (a terminal's) is still one Ctrl-C in each
    worker. Only the main thread can own signal handlers: elsewhere it is inert."""

    def __init__(self, log=None, on_term: Callable[[], None] | None = None):
        self.requested = False
        self.reason: str | None = None
        self.log = log
        self.on_term = on_term
        self._sigints = 0
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNAL_NAMES}
        return self

    def _handle(self, signum, frame) -> None:
        self._sigints += signum == signal.SIGINT
        if self.on_term is not None and (signum == signal.SIGTERM or self._sigints == 1):
            self.on_term()
        if self._sigints > 1:
            raise KeyboardInterrupt
        if self.requested:
            return
        self.requested, self.reason = True, SIGNAL_NAMES[signum]
        if self.log is not None:
            again = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
            self.log(f"{self.reason}: {STOPPING}{again}")

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def exit_with_parent(parent: int) -> None:
    """End this process as soon as its parent, the process `parent` (its PID, passed in by the
    parent: one that died while this process was still starting would already read as 1 here),
    is gone, e.g. killed with SIGKILL: an orphaned worker would go on writing into the run
    directory, and an orphaned reward process stuck in a loop would never end."""

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
