"""The reward process (`python -m tailtamer.rl.reward_worker READ_FD WRITE_FD PARENT_PID`), started by
`RewardScorer`: it loads the reward once, then scores batches one call at a time, answering
each call on its own so the trainer can charge a hang or a crash to the sample that caused it.

Messages (pickled): in, `(specs, sys.path)` then `("score", [(function index, response,
answer, context), ...])`; out, `("ready", None)` or `(kind, message)` after loading, then per
call `("ok", float)` or `(kind, message)` with kind the exception's type name or `not a number`.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection

from tailtamer.stopping import exit_with_parent


def main(read_fd: int, write_fd: int, parent: int) -> None:
    exit_with_parent(parent)
    for stop in (signal.SIGINT, signal.SIGTERM):  # the trainer's to handle (it ends its step); it stops us
        signal.signal(stop, signal.SIG_IGN)
    # A reward that prints must not be able to corrupt the channel: stdout goes to stderr.
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    specs, path = inbox.recv()
    # The trainer's import path, and its working directory first: `rl.reward=myreward:fn` finds
    # ./myreward.py whether the trainer runs as `tailtamer` or `python -m tailtamer`.
    sys.path[:] = [os.getcwd()] + [p for p in path if p not in ("", os.getcwd())]
    from tailtamer.errors import ConfigError
    from tailtamer.rl.rewards import NotANumber, check_reward_value, resolve_reward, reward_caller

    calls = []
    for spec in specs:
        try:
            fn = resolve_reward(spec) if isinstance(spec, str) else pickle.loads(spec)
            calls.append(reward_caller(fn, spec if isinstance(spec, str) else getattr(fn, "__name__", "function")))
        except ConfigError as e:
            outbox.send(("config", str(e)))
            return
        except BaseException as e:  # an unpicklable function, or a module that exits or is interrupted on import
            outbox.send(("config", f"rl.reward {spec if isinstance(spec, str) else ''}: cannot load the reward "
                                   f"function ({type(e).__name__}: {e})"))
            return
    outbox.send(("ready", None))
    while True:
        try:
            _, items = inbox.recv()
        except EOFError:
            return
        for j, response, answer, context in items:
            try:
                outbox.send(("ok", check_reward_value(calls[j](response, answer, context))))
            except NotANumber as e:
                outbox.send(("not a number", f"the reward {e}"))
            except BaseException as e:  # user code can fail in any way: one sample scores 0, counted
                outbox.send((type(e).__name__, f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
