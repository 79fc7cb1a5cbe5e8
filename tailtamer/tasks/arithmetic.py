"""The built-in reasoning task: chains of additions and subtractions, solved step by step.

A problem is a start value and a list of one-digit operations, e.g. the prompt `47+8-3+9=?`.
The reference response writes one line per step and ends with the answer:

    47+8=55
    55-3=52
    check 55-3=52 ok
    52+9=61
    answer: 61

Two things make the response lengths long-tailed the way reasoning RL's are:
  - across prompts, the number of operations follows a truncated power law
    P(k) ∝ k^(-alpha), so most problems are short and a few are very long;
  - within one prompt, each step is followed by a "check" line with probability
    `check_prob`, so sibling samples of the same prompt differ in length too.
The reward (1.0 for the right final answer, else 0.0) only reads the `answer:` line.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from tailtamer.errors import ConfigError

ANSWER_RE = re.compile(r"answer:\s*(-?\d+)")
# The held-out problems' seed: SFT draws its problems from SFTConfig.seed, so evaluation never overlaps them.
HELD_OUT_SEED = 1_000_003
OP_RE = re.compile(r"[+-]\d")


@dataclass(frozen=True)
class ArithmeticTask:
    min_ops: int = 1
    max_ops: int = 24
    alpha: float = 1.3  # power-law exponent of the number of operations
    check_prob: float = 0.15  # chance of a self-check line after each step
    max_value: int = 99  # values stay in [0, max_value]

    def __post_init__(self):
        if not 1 <= self.min_ops <= self.max_ops:
            raise ConfigError(f"task: need 1 <= min_ops <= max_ops, got {self.min_ops}, {self.max_ops}")
        if not 0 <= self.check_prob < 1:
            raise ConfigError(f"task.check_prob must be in [0, 1), got {self.check_prob}")
        if self.max_value < 18:
            raise ConfigError(f"task.max_value must be >= 18, got {self.max_value}")

    @staticmethod
    def num_ops(prompt: str) -> int:
        """Operations in a prompt such as `47+8-3=?`."""
        return len(OP_RE.findall(prompt))

    def num_ops_weights(self) -> list[float]:
        return [k ** -self.alpha for k in range(self.min_ops, self.max_ops + 1)]

    def sample(self, rng: random.Random) -> dict:
        """One problem: {"prompt", "answer", "trace"} (trace = a correct reference response)."""
        k = rng.choices(range(self.min_ops, self.max_ops + 1), weights=self.num_ops_weights())[0]
        start = value = rng.randint(10, self.max_value)
        ops = []
        for _ in range(k):
            d = rng.randint(1, 9)
            sign = rng.choice("+-")
            if sign == "+" and value + d > self.max_value:
                sign = "-"
            elif sign == "-" and value - d < 0:
                sign = "+"
            value = value + d if sign == "+" else value - d
            ops.append(f"{sign}{d}")
        return {"prompt": f"{start}{''.join(ops)}=?\n", "answer": str(value),
                "trace": self.write_trace(start, ops, rng)}

    def write_trace(self, start: int, ops: list[str], rng: random.Random) -> str:
        """A correct step-by-step response; its self-check lines are random, so one prompt
        has correct responses of many lengths."""
        value, lines = start, []
        for op in ops:
            new = value + int(op)
            lines.append(f"{value}{op}={new}")
            if rng.random() < self.check_prob:
                lines.append(f"check {value}{op}={new} ok")
            value = new
        lines.append(f"answer: {value}")
        return "\n".join(lines)

    def problems(self, n: int, seed: int) -> Iterator[dict]:
        """`n` problems drawn from `seed`, one at a time (a large n need not fit in memory)."""
        rng = random.Random(seed)
        return (self.sample(rng) for _ in range(n))

    def dataset(self, n: int, seed: int) -> list[dict]:
        return list(self.problems(n, seed))


def extract_answer(response: str) -> str | None:
    """The last `answer: N` in a response, or None."""
    found = ANSWER_RE.findall(response)
    return found[-1] if found else None


def reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference answer, else 0.0."""
    return float(extract_answer(response) == str(answer).strip())


def length_stats(lengths: list[int]) -> dict:
    """p50 / p90 / max of response lengths, and the tail ratio max/p50 that TLT targets."""
    arr = np.asarray(lengths, dtype=float)
    if arr.size == 0:
        return {"n": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0, "max_over_p50": 0.0}
    p50 = float(np.percentile(arr, 50))
    return {"n": int(arr.size), "mean": float(arr.mean()), "p50": p50, "p90": float(np.percentile(arr, 90)),
            "max": float(arr.max()), "max_over_p50": float(arr.max() / p50) if p50 else float("inf")}
