"""Verifiable rewards: the built-in task's, a math-verify reward, and user functions.

A reward function is `fn(response: str, answer: str) -> float`, or verl's
`compute_score(data_source, solution_str, ground_truth, extra_info=None)` returning a float or
a dict with `score` (called with the row's `data_source` and `extra_info`; `reward_caller`
tells the two apart by their parameter names). Rewards are user code, so
they run in a separate process (`RewardScorer`): one that raises, returns something that is
not a finite number, runs past the timeout, or kills its process (`os._exit`, a segfault)
scores 0 for that sample; the failure is counted by kind with its first message, and the run
goes on. Running them in a process of their own is also what lets math-verify use
`signal.alarm` (it only can in a main thread).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import re
import subprocess
import sys
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

from tailtamer.errors import ConfigError
from tailtamer.tasks.arithmetic import reward as builtin_reward

BOXED_RE = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
START_TIMEOUT_S = 120.0  # importing a user's reward module (sympy, a verifier library) may be slow


def math_reward(response: str, answer: str) -> float:
    """1.0 when the last \\boxed{...} (or, failing that, the response) is mathematically equal to
    the answer per the `math-verify` library (HF), else 0.0."""
    from math_verify import parse, verify

    boxed = BOXED_RE.findall(response)
    candidate = f"${boxed[-1]}$" if boxed else response
    gold = parse(f"${answer}$") or parse(str(answer))
    return float(bool(verify(gold, parse(candidate))))


def load_user_reward(spec: str) -> Callable[[str, str], float]:
    """`package.module:function` or `path/to/file.py:function`."""
    if ":" not in spec:
        raise ConfigError(f"rl.reward {spec!r}: expected builtin, math, module:function or file.py:function")
    target, name = spec.rsplit(":", 1)
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise ConfigError(f"rl.reward: {path} not found")
            module_spec = importlib.util.spec_from_file_location(f"tailtamer_user_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except BaseException as e:  # the user's module failed to import (or exited): say which and why
        raise ConfigError(f"rl.reward {spec!r}: cannot import {target} ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"rl.reward {spec!r}: {target} has no function {name!r}")
    return fn


def resolve_reward(spec: str) -> Callable[[str, str], float]:
    if spec == "builtin":
        return builtin_reward
    if spec == "math":
        if importlib.util.find_spec("math_verify") is None:
            raise ConfigError("rl.reward 'math' needs the math-verify package: pip install math-verify")
        return math_reward
    return load_user_reward(spec)


ACCEPTED_SIGNATURES = ("fn(response, answer), or verl's compute_score(data_source, solution_str, ground_truth, "
                       "extra_info=None)")


def reward_caller(fn: Callable, name: str) -> Callable[[str, str, dict], object]:
    """`call(response, answer, context)` for a reward function, chosen once from its signature:
    verl's keywords when it names `solution_str` and `ground_truth` (`data_source` and
    `extra_info` come from the row's context), else two positional arguments. Any other
    signature is a ConfigError naming the accepted ones."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without an introspectable signature
        return lambda response, answer, context: fn(response, answer)
    params = sig.parameters
    if "solution_str" in params and "ground_truth" in params:
        wanted = {"data_source", "solution_str", "ground_truth", "extra_info"}
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        names = wanted if takes_all else wanted & set(params)
        try:
            sig.bind(**{k: None for k in names})
        except TypeError:
            raise ConfigError(f"rl.reward {name}: its signature {sig} needs arguments tailtamer does not have; "
                              f"accepted: {ACCEPTED_SIGNATURES}") from None

        def verl(response, answer, context):
            given = {"data_source": context.get("data_source"), "solution_str": response, "ground_truth": answer,
                     "extra_info": context.get("extra_info")}
            return fn(**{k: v for k, v in given.items() if k in names})
        return verl
    try:
        sig.bind("response", "answer")
    except TypeError:
        raise ConfigError(f"rl.reward {name}: its signature {sig} takes neither form; accepted: "
                          f"{ACCEPTED_SIGNATURES}") from None
    return lambda response, answer, context: fn(response, answer)


class NotANumber(ValueError):
    """A reward function returned something other than a finite number."""


def check_reward_value(value) -> float:
    """The reward as a float, or NotANumber: a number (bool counts: `return answer == x`) that
    is finite. A string such as '0.5' is refused, not parsed: it is a bug in the function."""
    if isinstance(value, dict):  # verl's reward functions may return {"score": ..., other metrics}
        if "score" not in value:
            raise NotANumber(f"returned a dict without 'score' (keys {sorted(value)[:5]})")
        value = value["score"]
    if isinstance(value, bool):
        return float(value)
    if not hasattr(value, "__float__") or isinstance(value, (str, bytes)):
        raise NotANumber(f"returned {type(value).__name__} {value!r:.40}, not a number")
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):
        raise NotANumber(f"returned {number}")
    return number


@dataclass
class RewardScorer:
    """Scores responses in a child process (tailtamer/rl/reward_worker.py) with a timeout per
    call. A call that times out or kills the child is charged to its own sample; the child is
    restarted and the remaining samples go on. `reward` is a spec (`builtin`, `math`,
    `module:function`, `file.py:function`) or a picklable function."""

    reward: str | Callable
    timeout_s: float = 5.0
    failures: dict = field(default_factory=dict)  # kind -> {"count": n, "first": message}
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _conn: Connection | None = field(default=None, repr=False)

    def __post_init__(self):
        self._start()  # a reward that cannot load is a start-up error, not a failure per sample

    # --- the child process ------------------------------------------------------------------

    def _start(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tailtamer.rl.reward_worker", str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self._conn = _Duplex(from_child_r, to_child_w)
        spec = self.reward if isinstance(self.reward, str) else pickle.dumps(self.reward)
        self._conn.send((spec, sys.path))
        if not self._conn.poll(START_TIMEOUT_S):
            self.close()
            raise ConfigError(f"rl.reward {self._name()}: loading it took longer than {START_TIMEOUT_S:.0f} s")
        try:
            kind, message = self._conn.recv()
        except (EOFError, OSError):
            code = self._stop()
            raise ConfigError(f"rl.reward {self._name()}: its process died while loading it (exit code {code})") from None
        if kind != "ready":
            self.close()
            raise ConfigError(message)

    def _stop(self) -> int | None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        code = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            code = self._proc.wait()
            self._proc = None
        return code

    def close(self) -> None:
        self._stop()

    def __del__(self):
        self._stop()

    def _name(self) -> str:
        return self.reward if isinstance(self.reward, str) else getattr(self.reward, "__name__", repr(self.reward))

    # --- scoring ----------------------------------------------------------------------------

    def score_batch(self, items: list[tuple]) -> list[tuple[float, bool]]:
        """[(reward, ok)] for (response, answer) or (response, answer, row context) items, in
        order; a failed call gives (0.0, False)."""
        items = [(item[0], item[1], item[2] if len(item) > 2 else {}) for item in items]
        out: list[tuple[float, bool]] = []
        while len(out) < len(items):
            if self._conn is None:
                self._start()
            pending = items[len(out):]
            try:
                self._conn.send(("score", pending))
            except OSError:  # it died between batches: start a fresh one
                self._stop()
                continue
            for _ in pending:
                if not self._conn.poll(self.timeout_s):
                    self._stop()
                    out.append(self._fail("timeout", f"a call took longer than rl.reward_timeout_s={self.timeout_s}"))
                    break
                try:
                    kind, value = self._conn.recv()
                except (EOFError, OSError):
                    code = self._stop()
                    out.append(self._fail("process died", f"the reward's process died (exit code {code})"))
                    break
                out.append((value, True) if kind == "ok" else self._fail(kind, value))
        return out

    def score(self, response: str, answer: str) -> float:
        return self.score_batch([(response, answer)])[0][0]

    def _fail(self, kind: str, message: str) -> tuple[float, bool]:
        entry = self.failures.setdefault(kind, {"count": 0, "first": message})
        entry["count"] += 1
        return 0.0, False

    def counts(self) -> dict:
        timeouts = self.failures.get("timeout", {}).get("count", 0)
        return {"reward_errors": sum(v["count"] for v in self.failures.values()) - timeouts,
                "reward_timeouts": timeouts}


class _Duplex:
    """A pickled-message channel over two pipe ends (read, write)."""

    def __init__(self, read_fd: int, write_fd: int):
        self.reader, self.writer = Connection(read_fd, writable=False), Connection(write_fd, readable=False)

    def send(self, obj) -> None:
        self.writer.send(obj)

    def recv(self):
        return self.reader.recv()

    def poll(self, timeout: float) -> bool:
        return self.reader.poll(timeout)

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


def merge_failures(parts: list[dict]) -> dict:
    """Failure tallies of several scorers (workers) summed by kind; the first message is the
    lowest worker's."""
    merged: dict = {}
    for part in parts:
        for kind, entry in part.items():
            into = merged.setdefault(kind, {"count": 0, "first": entry["first"]})
            into["count"] += entry["count"]
    return merged
