"""Verifiable rewards: the built-in task's, a math-verify reward, and user functions.

A reward function is `fn(response: str, answer: str) -> float`. One that raises, returns a
non-number or runs past the timeout scores 0 for that sample; the failure is counted and
logged, and the run goes on.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tailtamer.errors import ConfigError
from tailtamer.tasks.arithmetic import reward as builtin_reward

BOXED_RE = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


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
    except Exception as e:  # the user's module failed to import: say which and why
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


@dataclass
class RewardScorer:
    """Scores responses with a timeout per call (a daemon thread, so a hung call can neither
    block the run nor its exit); counts failures instead of raising."""

    fn: Callable[[str, str], float]
    timeout_s: float = 5.0
    errors: int = 0
    timeouts: int = 0
    last_error: str | None = None

    def score(self, response: str, answer: str) -> float:
        box: dict = {}

        def call():
            try:
                box["value"] = self.fn(response, answer)
            except Exception as e:  # a user's reward can fail in any way: it scores 0 and is counted
                box["error"] = e

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            self.timeouts += 1
            self.last_error = f"timed out after {self.timeout_s}s"
            return 0.0
        try:
            if "error" in box:
                raise box["error"]
            value = float(box["value"])
            if not math.isfinite(value):
                raise ValueError(f"reward is {value}")
            return value
        except Exception as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            return 0.0

    def counts(self) -> dict:
        return {"reward_errors": self.errors, "reward_timeouts": self.timeouts}
