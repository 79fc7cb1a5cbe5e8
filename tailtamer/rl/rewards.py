"""Verifiable rewards: the built-in task's, a math-verify reward, routing by `data_source`,
and user functions, several of them weighted.

A reward function is `fn(response: str, answer: str) -> float`, or verl's
`compute_score(data_source, solution_str, ground_truth, extra_info=None)` returning a float or
a dict with `score` (called with the row's `data_source` and `extra_info`; `reward_caller`
tells the two apart by their parameter names). `rl.reward` names one or several (TRL's
`reward_funcs`); a sample's reward is their sum weighted by `rl.reward_weights`, and each is
logged on its own. Rewards are user code, so
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


def user_reward_target(spec: str) -> tuple[str, str]:
    """(module or file, function) of `package.module:function` or `path/to/file.py:function`;
    a file that is not there is said here (the launcher checks before any worker starts)."""
    if ":" not in spec:
        raise ConfigError(f"rl.reward {spec!r}: expected auto, builtin, math, module:function or file.py:function")
    target, name = spec.rsplit(":", 1)
    if not name:
        raise ConfigError(f"rl.reward {spec!r}: no function name after ':' (module:function or file.py:function)")
    if target.endswith(".py") and not Path(target).is_file():
        raise ConfigError(f"rl.reward: {target} not found")
    return target, name


def load_user_reward(spec: str) -> Callable[[str, str], float]:
    """`package.module:function` or `path/to/file.py:function`."""
    target, name = user_reward_target(spec)
    try:
        if target.endswith(".py"):
            path = Path(target)
            # the file's own directory, so that it imports its neighbours as `python file.py` would
            folder = str(path.resolve().parent)
            if folder not in sys.path:  # after the installed modules, which a neighbour must not shadow
                sys.path.append(folder)
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
    if fn is None:
        raise ConfigError(f"rl.reward {spec!r}: {target} has no function {name!r}")
    if not callable(fn):
        raise ConfigError(f"rl.reward {spec!r}: {target}'s {name!r} is a {type(fn).__name__}, not a function")
    if isinstance(fn, type):  # calling it would build an instance per sample, scored as no number
        raise ConfigError(f"rl.reward {spec!r}: {target}'s {name!r} is a class, not a function; name a function, "
                          f"or an instance with a __call__ method")
    return fn


# `rl.reward=auto`: the built-in scorer for a row's `data_source` (verl's names), first match
# wins; a row without one is scored as the built-in task.
DATA_SOURCES = (
    ("gsm8k", "math"), ("math", "math"), ("aime", "math"), ("amc", "math"), ("numina", "math"),
    ("deepscaler", "math"), ("olympiad", "math"),
)


def route(data_source) -> str | None:
    """The built-in scorer (`builtin` or `math`) for a row's `data_source`: `builtin` when
    the row has none, else the first DATA_SOURCES entry that begins one of the source's words
    (split at anything not a letter or digit, case-insensitive: `openai/gsm8k`,
    `lighteval/MATH`, `math_dapo`, `AIME2024`, but not `aftermath_news`), None when none does."""
    if data_source is None:
        return "builtin"
    if not isinstance(data_source, str):
        return None
    if data_source.lower() == "tailtamer/arithmetic":
        return "builtin"
    words = re.split(r"[^a-z0-9]+", data_source.lower())
    return next((scorer for name, scorer in DATA_SOURCES if any(w.startswith(name) for w in words)), None)


def auto_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """`rl.reward=auto`: the row's data_source picks the built-in scorer (see `route`; the
    trainer checks every row at start-up, so an unknown source never reaches here)."""
    scorer = route(data_source)
    if scorer is None:
        raise ValueError(f"no built-in scorer for data_source {data_source!r}")
    return BUILTIN_REWARDS[scorer](solution_str, ground_truth)


def check_routes(rows: list[dict], where: str) -> set[str]:
    """The built-in scorers `rl.reward=auto` will use for `rows` (each with its 1-based `_row`
    in the file `where`); a row whose data_source has none is a ConfigError naming it."""
    used = set()
    for row in rows:
        source = row.get("context", {}).get("data_source")
        scorer = route(source)
        if scorer is None:
            raise ConfigError(f"{where}:{row.get('_row', '?')}: data_source {source!r} has no built-in scorer "
                              f"(rl.reward=auto knows tailtamer/arithmetic and sources with a word beginning with "
                              f"{', '.join(n for n, _ in DATA_SOURCES)}); "
                              f"give rl.reward=math or module:function")
        used.add(scorer)
    if "math" in used:
        _check_math_verify("auto (rows routed to math)")
    return used


def _check_math_verify(spec: str) -> None:
    if importlib.util.find_spec("math_verify") is None:
        raise ConfigError(f"rl.reward {spec} needs the math-verify package: pip install math-verify")


BUILTIN_REWARDS = {"builtin": builtin_reward, "math": math_reward}


def resolve_reward(spec: str) -> Callable:
    if spec == "math":
        _check_math_verify("math")
    if spec == "auto":
        return auto_reward
    return BUILTIN_REWARDS.get(spec) or load_user_reward(spec)


def reward_name(spec) -> str:
    """How a reward function is logged: `math`, or the function's name for `file.py:fn`."""
    if isinstance(spec, str):
        return spec.rsplit(":", 1)[-1]
    return getattr(spec, "__name__", "reward")


def reward_names(specs) -> list[str]:
    """Distinct log names for several reward functions (a repeated name gets its position)."""
    names = [reward_name(s) for s in specs]
    return [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


ACCEPTED_SIGNATURES = ("fn(response, answer), or verl's compute_score(data_source, solution_str, ground_truth, "
                       "extra_info=None)")


def reward_caller(fn: Callable, name: str) -> Callable[[str, str, dict], object]:
    """`call(response, answer, context)` for a reward function, chosen once from its signature:
    verl's keywords when it names `solution_str` and `ground_truth` (`data_source` and
    `extra_info` come from the row's context), else `response` and `answer` by name when it
    names both, else two positional arguments. Any other signature is a ConfigError naming the
    accepted ones."""
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
    names = list(params)
    if "response" in params and "answer" in params:
        try:
            sig.bind("response", "answer")
            in_order = names.index("response") < names.index("answer")
        except TypeError:  # keyword-only: `fn(*, response, answer)`
            in_order = False
        if not in_order:  # by name, so each gets its own (`fn(answer, response)` in order would get the other)
            try:
                sig.bind(response=None, answer=None)
                return lambda response, answer, context: fn(response=response, answer=answer)
            except TypeError:  # positional-only parameters: passed in order, as below
                pass
    try:
        sig.bind("response", "answer")
    except TypeError:
        raise ConfigError(f"rl.reward {name}: its signature {sig} takes neither form; accepted: "
                          f"{ACCEPTED_SIGNATURES}") from None
    return lambda response, answer, context: fn(response, answer)


# Timeouts in a row, of a reward that has never answered, after which the rest of a batch is
# failed uncalled (RewardScorer).
NEVER_ANSWERED = 3


# A step's rewards are float32 (at most 3.4e38), weighted and summed over functions and over a
# group for its mean: 1e18 leaves room for any group and weights a run would use.
MAX_REWARD = 1e18


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
    if abs(number) > MAX_REWARD:
        raise NotANumber(f"returned {number:g}, beyond ±{MAX_REWARD:g}: the step's float32 rewards, weighted and "
                         f"summed over a group, could overflow")
    return number


@dataclass
class RewardScorer:
    """Scores responses in a child process (tailtamer/rl/reward_worker.py) with a timeout per
    call. A call that times out or kills the child is charged to its own sample and function;
    the child is restarted and the remaining calls go on. `reward` is a spec (`auto`,
    `builtin`, `math`, `module:function`, `file.py:function`), a picklable function, or a
    sequence of them, summed with `weights` (default: 1 each). What the functions print goes
    to the file `output` (appended) when given, else to stderr. A reward that has never
    answered and times out NEVER_ANSWERED times in a row fails the rest of its batch uncalled:
    each call would wait out the timeout in a fresh process (128 samples at 5 s: over 10
    minutes before the step's "every reward failed" stop)."""

    reward: str | Callable | tuple
    timeout_s: float = 5.0
    weights: tuple[float, ...] = ()
    output: Path | None = None
    failures: dict = field(default_factory=dict)  # kind -> {"count": n, "first": message}
    answered: bool = False  # whether any call has come back (a value or an error)
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _conn: Connection | None = field(default=None, repr=False)

    def __post_init__(self):
        self.specs = tuple(self.reward) if isinstance(self.reward, (tuple, list)) else (self.reward,)
        self.weights = tuple(self.weights) or (1.0,) * len(self.specs)
        if len(self.weights) != len(self.specs):
            raise ConfigError(f"rl.reward_weights: {len(self.weights)} weights for {len(self.specs)} reward functions")
        self.names = reward_names(self.specs)
        self._start()  # a reward that cannot load is a start-up error, not a failure per sample

    # --- the child process ------------------------------------------------------------------

    def _start(self) -> None:
        output = open(self.output, "ab") if self.output is not None else None
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tailtamer.rl.reward_worker", str(to_child_r), str(from_child_w),
                 str(os.getpid())],
                pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, stdout=output, stderr=output)
        finally:
            if output is not None:
                output.close()
        os.close(to_child_r)
        os.close(from_child_w)
        self._conn = _Duplex(from_child_r, to_child_w)
        specs = [s if isinstance(s, str) else pickle.dumps(s) for s in self.specs]
        self._conn.send((specs, sys.path))
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
        return ", ".join(s if isinstance(s, str) else reward_name(s) for s in self.specs)

    # --- scoring ----------------------------------------------------------------------------

    def score_calls(self, items: list[tuple]) -> list[list[tuple[float, bool]]]:
        """Per item, [(value, ok)] of each reward function, for (response, answer) or
        (response, answer, row context) items, in order; a failed call gives (0.0, False)."""
        items = [(item[0], item[1], item[2] if len(item) > 2 else {}) for item in items]
        calls = [(j, *item) for item in items for j in range(len(self.specs))]
        out: list[tuple[float, bool]] = []
        timeouts = 0  # in a row
        while len(out) < len(calls):
            if not self.answered and timeouts >= NEVER_ANSWERED:
                out += [self._fail("timeout", f"not called: its first {timeouts} calls took longer than "
                                              f"rl.reward_timeout_s={self.timeout_s}", j) for j, *_ in calls[len(out):]]
                break
            if self._conn is None:
                self._start()
            pending = calls[len(out):]
            try:
                self._conn.send(("score", pending))
            except OSError:  # it died between batches: start a fresh one
                self._stop()
                continue
            for j, *_ in pending:
                if not self._conn.poll(self.timeout_s):
                    self._stop()
                    timeouts += 1
                    out.append(self._fail("timeout", f"a call took longer than rl.reward_timeout_s={self.timeout_s}", j))
                    break
                try:
                    kind, value = self._conn.recv()
                except (EOFError, OSError):
                    code, timeouts = self._stop(), 0
                    out.append(self._fail("process died", f"the reward's process died (exit code {code})", j))
                    break
                timeouts, self.answered = 0, True
                out.append((value, True) if kind == "ok" else self._fail(kind, value, j))
        k = len(self.specs)
        return [out[i:i + k] for i in range(0, len(out), k)]

    def total(self, parts: list[tuple[float, bool]]) -> tuple[float, bool]:
        """(weighted sum of one item's function values, whether every call succeeded)."""
        return sum(w * v for w, (v, _) in zip(self.weights, parts)), all(ok for _, ok in parts)

    def score_batch(self, items: list[tuple]) -> list[tuple[float, bool]]:
        """[(reward, ok)] per item: the weighted sum over the reward functions; ok when every
        call succeeded (a failed call counts 0.0)."""
        return [self.total(parts) for parts in self.score_calls(items)]

    def score(self, response: str, answer: str) -> float:
        return self.score_batch([(response, answer)])[0][0]

    def _fail(self, kind: str, message: str, j: int) -> tuple[float, bool]:
        if len(self.specs) > 1:
            message = f"{self.names[j]}: {message}"
        entry = self.failures.setdefault(kind, {"count": 0, "first": message})
        entry["count"] += 1
        return 0.0, False

    def counts(self) -> dict:
        return failure_counts(self.failures)


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


def failure_counts(failures: dict) -> dict:
    """{reward_errors, reward_timeouts} from a tally by kind (timeouts counted apart)."""
    timeouts = failures.get("timeout", {}).get("count", 0)
    return {"reward_errors": sum(e["count"] for e in failures.values()) - timeouts, "reward_timeouts": timeouts}


def merge_failures(parts: list[dict]) -> dict:
    """Failure tallies of several scorers (workers) summed by kind; the first message is the
    lowest worker's."""
    merged: dict = {}
    for part in parts:
        for kind, entry in part.items():
            into = merged.setdefault(kind, {"count": 0, "first": entry["first"]})
            into["count"] += entry["count"]
    return merged
