"""Choosing the speculative strategy per decode step from live measurements.

BEG-MAB (bucketed ε-greedy multi-armed bandit; TLT §2.3, fastrl `eagle_mab.py`):
  - strategies are grouped by tokens-to-verify N, groups sorted by N descending;
  - batch-size thresholds t_1 = 1 < t_2 < ... < t_m split batch sizes into buckets
    B_i = [t_i, t_(i+1) − 1] (the last one open), and bucket i gets the i-th group, so small
    batches verify large trees and larger batches small ones (paper Table 4);
  - every bucket also has the arm "no SD", so a bucket where speculation loses falls back to
    plain decoding and the engine is never slower than plain decoding for long;
  - within a bucket: with probability ε a uniformly random arm, otherwise the arm with the
    highest median reward over its last `window` pulls (an arm never pulled scores +∞);
    reward r = tokens emitted / step seconds (accepted tokens per second). The median keeps
    one noisy step from deciding;
  - rewards are kept per batch-size class inside a bucket (batch sizes 2^k .. 2^(k+1) − 1),
    and arms are compared within the class of the step: tokens/s depends on the batch size
    as much as on the arm, and a bucket spans 3..64 running requests. Compared across the
    bucket, an arm last pulled at 64 running outscored the others' pulls at 5 running, and
    won steps it should not: stretches of plain steps that made up 30–40% of some rollouts'
    tokens in the default RL job (measured 2026-12-04, `tailtamer train` traces).
Unlike the reference defaults (one strategy per bucket, so nothing is learned; fastrl-code.md
§3.2), the default groups hold two strategies each plus "no SD".
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from dataclasses import dataclass, field

from tailtamer.errors import ConfigError
from tailtamer.rollout.speculative import Strategy

NO_SD = "plain"


def group_by_verify(strategies: list[Strategy]) -> list[list[Strategy]]:
    """Strategies grouped by tokens to verify, the group with the largest N first."""
    groups: dict[int, list[Strategy]] = {}
    for s in strategies:
        groups.setdefault(s.verify, []).append(s)
    return [groups[n] for n in sorted(groups, reverse=True)]


def bucket_of(batch_size: int, thresholds: list[int]) -> int:
    """Index i of the bucket [t_i, t_(i+1) − 1] holding batch_size (the last bucket is open)."""
    index = 0
    for i, t in enumerate(thresholds):
        if batch_size >= t:
            index = i
    return index


def size_class(batch_size: int) -> int:
    """k for batch sizes 2^k .. 2^(k+1) − 1: steps whose rewards are compared with each other."""
    return batch_size.bit_length() - 1


def median_reward(rewards) -> float:
    return statistics.median(rewards) if rewards else float("inf")


def epsilon_greedy(arms: list[str], medians: dict[str, float], epsilon: float, rng: random.Random) -> str:
    """With probability ε a uniform arm, else the best median (ties: the first listed)."""
    if len(arms) == 1:
        return arms[0]
    if rng.random() < epsilon:
        return rng.choice(arms)
    return max(arms, key=lambda a: medians[a])


class FixedTuner:
    """Always the same strategy (the `fixed` tuner; also what `spec.mode=on` uses)."""

    def __init__(self, strategy: Strategy):
        self.strategy = strategy
        self.strategies = [strategy]

    def select(self, batch_size: int) -> Strategy | None:
        return self.strategy

    def record(self, arm: Strategy | None, batch_size: int, seconds: float, tokens: int) -> None:
        pass

    def summary(self) -> dict:
        return {"tuner": "fixed", "strategy": self.strategy.name}


@dataclass
class _Arm:
    rewards: deque
    pulls: int = 0


@dataclass
class BEGTuner:
    strategies: list[Strategy]
    thresholds: list[int]
    epsilon: float = 0.1
    window: int = 30
    seed: int = 0
    groups: list[list[Strategy]] = field(init=False)
    names: list[list[str]] = field(init=False)  # bucket -> its arms' names, "no SD" last
    arms: list[dict[int, dict[str, _Arm]]] = field(init=False)  # bucket -> size class -> arm

    def __post_init__(self):
        if not self.strategies:
            raise ConfigError("spec.strategies is empty: give the bandit at least one strategy")
        names = [s.name for s in self.strategies]
        if len(set(names)) < len(names):
            raise ConfigError(f"spec.strategies names {sorted({n for n in names if names.count(n) > 1})} twice")
        self.groups = group_by_verify(self.strategies)
        validate_buckets(self.groups, self.thresholds)
        if not 0 <= self.epsilon <= 1:
            raise ConfigError(f"spec.epsilon must be in [0, 1], got {self.epsilon}")
        if self.window < 1:
            raise ConfigError(f"spec.window must be >= 1, got {self.window}")
        self.rng = random.Random(self.seed)
        self.by_name = {s.name: s for s in self.strategies}
        self.names = [[s.name for s in g] + [NO_SD] for g in self.groups]
        self.arms = [{} for _ in self.groups]

    def _arms(self, batch_size: int) -> dict[str, _Arm]:
        """The arms of batch_size's bucket, with the rewards of its size class."""
        i, k = bucket_of(batch_size, self.thresholds), size_class(batch_size)
        if k not in self.arms[i]:
            self.arms[i][k] = {name: _Arm(deque(maxlen=self.window)) for name in self.names[i]}
        return self.arms[i][k]

    def select(self, batch_size: int) -> Strategy | None:
        arms = self._arms(batch_size)
        choice = epsilon_greedy(list(arms), {n: median_reward(a.rewards) for n, a in arms.items()},
                                self.epsilon, self.rng)
        return None if choice == NO_SD else self.by_name[choice]

    def record(self, arm: Strategy | None, batch_size: int, seconds: float, tokens: int) -> None:
        if seconds <= 0:
            return
        entry = self._arms(batch_size)[NO_SD if arm is None else arm.name]
        entry.rewards.append(tokens / seconds)
        entry.pulls += 1

    def bucket_sizes(self, i: int) -> tuple[int, int | None]:
        """Bucket i's batch sizes [t_i, t_(i+1) − 1]; None: the last bucket is open."""
        return self.thresholds[i], self.thresholds[i + 1] - 1 if i + 1 < len(self.thresholds) else None

    def summary(self) -> dict:
        """Per bucket: its batch sizes, pulls per arm, and per size class seen the pulls,
        the median rewards and the best arm."""
        out = []
        for i, names in enumerate(self.names):
            lo, hi = self.bucket_sizes(i)
            classes = []
            for k, arms in sorted(self.arms[i].items()):
                medians = {n: median_reward(a.rewards) for n, a in arms.items() if a.rewards}
                top = 2 ** (k + 1) - 1 if hi is None else min(hi, 2 ** (k + 1) - 1)
                classes.append({"batch_sizes": [max(lo, 2 ** k), top],
                                "pulls": {n: a.pulls for n, a in arms.items()},
                                "median_tokens_per_s": {n: round(m, 1) for n, m in medians.items()},
                                "best": max(medians, key=medians.get) if medians else None})
            pulls = {n: sum(c["pulls"][n] for c in classes) for n in names}
            out.append({"batch_sizes": [lo, hi], "pulls": pulls, "classes": classes})
        return {"tuner": "beg", "buckets": out}


def validate_buckets(groups: list[list[Strategy]], thresholds: list[int]) -> None:
    # the values first: a negative threshold is the mistake to name, not the count
    if not thresholds or thresholds[0] != 1 or any(b <= a for a, b in zip(thresholds, thresholds[1:])):
        raise ConfigError(f"spec.bucket_thresholds must start at 1 and increase strictly, got {thresholds}")
    if len(thresholds) != len(groups):
        sizes = [g[0].verify for g in groups]
        raise ConfigError(f"spec.bucket_thresholds has {len(thresholds)} entries but the strategies form "
                          f"{len(groups)} groups by tokens to verify {sizes}: give one threshold per group")
