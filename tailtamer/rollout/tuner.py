"""Choosing the speculative strategy per decode step from live measurements.

BEG-MAB (bucketed multi-armed bandit; TLT §2.3, fastrl `eagle_mab.py`):
  - strategies are grouped by the tokens they verify at most (N; N + M for a fused tree,
    `Strategy.width`), groups sorted by it, descending;
  - batch-size thresholds t_1 = 1 < t_2 < ... < t_m split batch sizes into buckets
    B_i = [t_i, t_(i+1) − 1] (the last one open), and bucket i gets the i-th group, so small
    batches verify large trees and larger batches small ones (paper Table 4);
  - every bucket also has the arm "no SD", so a bucket where speculation loses falls back to
    plain decoding and the engine is never slower than plain decoding for long;
  - rewards are kept per batch-size class inside a bucket (batch sizes 2^k .. 2^(k+1) − 1),
    and arms are compared within the class of the step: tokens/s depends on the batch size
    as much as on the arm, and a bucket spans 3..64 running requests. Compared across the
    bucket, an arm last pulled at 64 running outscored the others' pulls at 5 running, and
    won steps it should not: stretches of plain steps that made up 30–40% of some rollouts'
    tokens in the default RL job (measured 2026-12-04, `tailtamer train` traces);
  - reward r = tokens emitted / step seconds (accepted tokens per second). An arm is judged
    by its rewards from the last `window` steps of its class (a sliding window, Garivier &
    Moulines 2011): older ones expire, and an arm with none left is tried again, so evidence
    from a cold start, a slow stretch of the machine or an older drafter cannot keep an arm
    out for good;
  - within a class: the arm with the highest optimistic score median · exp(c·σ/√n)
    (`optimistic_score`), with probability ε (0 by default) a uniformly random arm instead.

The paper's rule is ε-greedy on the median of an arm's last pulls (ε = 0.1; fastrl's UCB1
mode adds √(2 ln n / n_i) to a trimmed mean, a bonus in the reward's units, which tokens/s
are not). Kept from rollout to rollout, as training keeps it, that rule (with 30 pulls an
arm) locked onto a 38% slower arm for a whole `bench rollout` run (one run of seven,
2026-12-05): the few pulls of a class seen only in a rollout's first
steps decided it, and each ε pull there costs up to 30 ms (plain decoding at 512 running).
Against it, in one process each, 5 interleaved rollouts of that benchmark after a warm-up:
this rule 1.55–1.64× plain, ε-greedy 1.40–1.60× (8 processes, this one faster in every
one); a simulation drawing rewards from round-robin pulls of every arm, regret 19 against
35 ms a rollout, the worst of 1,000 runs 86 against 194 (`docs/measurements.md`). Unlike
the reference defaults (one strategy per bucket, so nothing is learned; fastrl-code.md
§3.2), the default groups hold two strategies each plus "no SD".
"""

from __future__ import annotations

import math
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
        groups.setdefault(s.width, []).append(s)
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


# σ of a class's log rewards before it has 4 residuals to measure it, and the least σ used: a
# quiet class still re-tries an arm it has pulled once or twice. Round-robin pulls measured
# 0.02–0.15 per class on the Xeon (2026-12-05), more with the machine busy.
PRIOR_SPREAD, MIN_SPREAD = 0.2, 0.05


def log_spread(log_rewards: list[list[float]], medians: list[float]) -> float:
    """σ of log rewards around their arm's median, pooled over arms with ≥ 2 rewards:
        σ = 1.4826 · median |ln r − ln median(arm)|
    (the median absolute deviation scaled to a normal's σ, Rousseeuw & Croux 1993, so one
    slow step moves it little). PRIOR_SPREAD with fewer than 4 such rewards; never below
    MIN_SPREAD. Takes the rewards' logs (`ln r`), which a caller keeps from step to step."""
    residuals = [abs(lr - lm) for lrs, m in zip(log_rewards, medians) if len(lrs) >= 2
                 for lm in (math.log(m),) for lr in lrs]
    if len(residuals) < 4:
        return PRIOR_SPREAD
    return max(MIN_SPREAD, 1.4826 * statistics.median(residuals))


def optimistic_score(median: float, n: int, spread: float, bonus: float) -> float:
    """An upper confidence bound on an arm's log reward, UCB1's shape (Auer, Cesa-Bianchi &
    Fischer 2002) with the median for the mean and the class's measured σ:
        score = median(r) · exp(c · σ / √n)   over the arm's n rewards in the window;
    +∞ with none, so that arm is tried (again). An arm pulled a few times keeps a chance to
    show it was unlucky; one pulled often is judged on its median."""
    if n == 0:
        return float("inf")
    return median * math.exp(bonus * spread / math.sqrt(n))


def choose(arms: list[str], scores: dict[str, float], epsilon: float, rng: random.Random) -> str:
    """With probability ε a uniform arm, else the best score (ties: the first listed)."""
    if len(arms) == 1:
        return arms[0]
    if epsilon > 0 and rng.random() < epsilon:
        return rng.choice(arms)
    return max(arms, key=lambda a: scores[a])


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
class _Class:
    """One batch-size class of a bucket: how many steps it has seen, and per arm its pulls
    and the (step, reward, ln reward) of those from the class's last `window` steps."""

    rewards: dict[str, deque]
    pulls: dict[str, int]
    steps: int = 0

    def record(self, name: str, reward: float, window: int) -> None:
        self.steps += 1
        self.rewards[name].append((self.steps, reward, math.log(reward)))
        self.pulls[name] += 1
        for kept in self.rewards.values():  # expire what left the window: a select reads only the rest
            while kept and kept[0][0] <= self.steps - window:
                kept.popleft()

    def medians(self) -> dict[str, tuple[float, int]]:
        """Per arm, the median of its rewards in the window and how many there are."""
        return {name: (statistics.median(r for _, r, _ in kept) if kept else math.nan, len(kept))
                for name, kept in self.rewards.items()}


@dataclass
class BEGTuner:
    strategies: list[Strategy]
    thresholds: list[int]
    epsilon: float = 0.0
    window: int = 60
    seed: int = 0
    bonus: float = 1.0
    groups: list[list[Strategy]] = field(init=False)
    names: list[list[str]] = field(init=False)  # bucket -> its arms' names, "no SD" last
    classes: list[dict[int, _Class]] = field(init=False)  # bucket -> size class -> its rewards

    def __post_init__(self):
        if not self.strategies:
            raise ConfigError("spec.strategies is empty: give the bandit at least one strategy")
        names = [s.name for s in self.strategies]
        if len(set(names)) < len(names):
            repeated = ", ".join(sorted({n for n in names if names.count(n) > 1}))
            raise ConfigError(f"spec.strategies names {repeated} more than once")
        self.groups = group_by_verify(self.strategies)
        validate_buckets(self.groups, self.thresholds)
        if not 0 <= self.epsilon <= 1:
            raise ConfigError(f"spec.epsilon must be in [0, 1], got {self.epsilon}")
        most = max(len(g) + 1 for g in self.groups)  # a bucket's arms, "no SD" included
        if self.window <= most:  # or a reward expires before the other arms have had a turn each
            raise ConfigError(f"spec.window must be more than the {most} arms of a bucket, got {self.window}")
        if not 0 <= self.bonus < math.inf:
            raise ConfigError(f"spec.bonus must be a number >= 0, got {self.bonus}")
        self.rng = random.Random(self.seed)
        self.by_name = {s.name: s for s in self.strategies}
        self.names = [[s.name for s in g] + [NO_SD] for g in self.groups]
        self.classes = [{} for _ in self.groups]

    def _class(self, batch_size: int) -> _Class:
        """batch_size's size class within its bucket."""
        i, k = bucket_of(batch_size, self.thresholds), size_class(batch_size)
        if k not in self.classes[i]:
            self.classes[i][k] = _Class({n: deque() for n in self.names[i]}, dict.fromkeys(self.names[i], 0))
        return self.classes[i][k]

    def scores(self, batch_size: int) -> dict[str, float]:
        """Each arm's `optimistic_score` in batch_size's class."""
        cls = self._class(batch_size)
        medians = cls.medians()
        logs = [[lr for _, _, lr in kept] for kept in cls.rewards.values()]
        spread = log_spread(logs, [m for m, _ in medians.values()])
        return {name: optimistic_score(m, n, spread, self.bonus) for name, (m, n) in medians.items()}

    def select(self, batch_size: int) -> Strategy | None:
        scores = self.scores(batch_size)
        choice = choose(list(scores), scores, self.epsilon, self.rng)
        return None if choice == NO_SD else self.by_name[choice]

    def record(self, arm: Strategy | None, batch_size: int, seconds: float, tokens: int) -> None:
        if not (seconds > 0 and tokens > 0):  # rewards are compared as logs: only positive ones
            return
        self._class(batch_size).record(NO_SD if arm is None else arm.name, tokens / seconds, self.window)

    def bucket_sizes(self, i: int) -> tuple[int, int | None]:
        """Bucket i's batch sizes [t_i, t_(i+1) − 1]; None: the last bucket is open."""
        return self.thresholds[i], self.thresholds[i + 1] - 1 if i + 1 < len(self.thresholds) else None

    def summary(self) -> dict:
        """Per bucket: its batch sizes, pulls per arm, and per size class seen the pulls,
        the median rewards in the window and the best of them."""
        out = []
        for i, names in enumerate(self.names):
            lo, hi = self.bucket_sizes(i)
            classes = []
            for k, cls in sorted(self.classes[i].items()):
                medians = {name: m for name, (m, n) in cls.medians().items() if n}
                top = 2 ** (k + 1) - 1 if hi is None else min(hi, 2 ** (k + 1) - 1)
                classes.append({"batch_sizes": [max(lo, 2 ** k), top],
                                "pulls": dict(cls.pulls),
                                "median_tokens_per_s": {n: round(m, 1) for n, m in medians.items()},
                                "best": max(medians, key=medians.get) if medians else None})
            pulls = {n: sum(c["pulls"][n] for c in classes) for n in names}
            out.append({"batch_sizes": [lo, hi], "pulls": pulls, "classes": classes})
        return {"tuner": "beg", "buckets": out}


def from_one_up(thresholds: list[int]) -> bool:
    """Whether bucket thresholds start at 1 and increase strictly."""
    return bool(thresholds) and thresholds[0] == 1 and all(b > a for a, b in zip(thresholds, thresholds[1:]))


def entries(n: int) -> str:
    """'1 entry', 'n entries': how an error counts a list's items."""
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def validate_buckets(groups: list[list[Strategy]], thresholds: list[int]) -> None:
    # the values first: a negative threshold is the mistake to name, not the count
    if not from_one_up(thresholds):
        raise ConfigError(f"spec.bucket_thresholds must start at 1 and increase strictly, got {thresholds}")
    if len(thresholds) != len(groups):
        sizes = [g[0].width for g in groups]
        raise ConfigError(f"spec.bucket_thresholds has {entries(len(thresholds))} but the strategies form "
                          f"{len(groups)} groups by tokens to verify {sizes}: give one threshold per group")
