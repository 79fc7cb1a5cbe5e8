"""What a rollout reports: tokens, time by kind of step, accept lengths, the running timeline."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from tailtamer.rollout.suffix_index import EAGLE, SOURCE_NAMES
from tailtamer.rollout.tuner import size_class


@lru_cache(maxsize=None)
def size_class_name(running: int) -> str:
    """The name of `running`'s batch-size class (`tuner.size_class`): "1", "2-3", "4-7", ..."""
    k = size_class(running)
    return str(running) if running == 1 else f"{2 ** k}-{2 ** (k + 1) - 1}"


def mean_accept_len(hist: dict[int, int]) -> float:
    """Tokens emitted per request per target forward while speculating (1.0 without SD), from
    a histogram {tokens emitted: request-steps}."""
    n = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / n if n else 1.0


@dataclass
class RolloutStats:
    tokens: int = 0
    seconds: float = 0.0
    prefill_s: float = 0.0
    decode_steps: int = 0  # target forwards after prefill (plain or verify)
    sd_steps: int = 0
    sd_seconds: float = 0.0
    plain_seconds: float = 0.0  # decode steps without speculation
    catch_up_s: float = 0.0  # the drafter catching up at each switch to SD (charged to no arm)
    setup_s: float = 0.0  # the proposer's one-off setup (compiling), in no step and not in `seconds`
    by_strategy: dict[str, dict] = field(default_factory=dict)  # name -> steps, seconds, tokens, request_steps
    accept_lens: dict[int, int] = field(default_factory=dict)  # tokens emitted per request-step -> count
    depth_accepts: dict[int, int] = field(default_factory=dict)  # draft depth d -> request-steps accepting >= d
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # where drafts came from (suffix_index.SOURCE_NAMES): tokens drafted by source, and accepted
    # ones by batch-size class ("1", "2-3", "4-7", ...) and source
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_class: dict[str, dict[str, int]] = field(default_factory=dict)
    request_steps_by_class: dict[str, int] = field(default_factory=dict)
    timeline: list[tuple[float, int, str]] = field(default_factory=list)  # (seconds, running, arm) per step
    seconds_by_running: dict[int, float] = field(default_factory=dict)  # decode seconds by requests running

    def record_step(self, end: float, seconds: float, running: int, arm: str, tokens: int) -> None:
        self.decode_steps += 1
        self.seconds_by_running[running] = self.seconds_by_running.get(running, 0.0) + seconds
        if arm == "plain":
            self.plain_seconds += seconds
        else:
            self.sd_steps += 1
            self.sd_seconds += seconds
            entry = self.by_strategy.setdefault(arm, {"steps": 0, "seconds": 0.0, "tokens": 0, "request_steps": 0})
            entry["steps"] += 1
            entry["seconds"] += seconds
            entry["tokens"] += tokens
            entry["request_steps"] += running
        self.timeline.append((end, running, arm))

    def record_sd(self, emitted: int, drafted: int, sources: list[int] | None = None, running: int = 1) -> None:
        """One request's SD step: `emitted` tokens (accepted drafts + the target's), `drafted`
        drafts, the sources of its accepted drafts (None: all the EAGLE drafter's), `running`
        requests in the step."""
        self.accept_lens[emitted] = self.accept_lens.get(emitted, 0) + 1
        self.drafted_tokens += drafted
        self.accepted_tokens += emitted - 1
        for d in range(1, emitted):
            self.depth_accepts[d] = self.depth_accepts.get(d, 0) + 1
        size = size_class_name(running)
        self.request_steps_by_class[size] = self.request_steps_by_class.get(size, 0) + 1
        by_class = self.accepted_by_class.setdefault(size, {})
        counts = {SOURCE_NAMES[EAGLE]: emitted - 1} if sources is None else Counter(SOURCE_NAMES[c] for c in sources[: emitted - 1])
        for name, n in counts.items():
            if n:
                by_class[name] = by_class.get(name, 0) + n

    def record_drafted_sources(self, counts: list[int] | None, drafted: list[int]) -> None:
        """A step's drafts by source code (None: all `drafted` the EAGLE drafter's)."""
        for code, n in enumerate(counts) if counts is not None else [(EAGLE, sum(drafted))]:
            if n and code in SOURCE_NAMES:
                name = SOURCE_NAMES[code]
                self.drafted_by_source[name] = self.drafted_by_source.get(name, 0) + n

    def tail_seconds(self, running: int = 4) -> float:
        """Decode time of the steps with at most `running` requests left: the long tail (by
        default <= 4, a fixed yardstick whatever spec.bs_threshold is)."""
        return sum(s for n, s in self.seconds_by_running.items() if n <= running)

    @property
    def sd_tokens(self) -> int:
        """Tokens emitted by SD steps."""
        return sum(v["tokens"] for v in self.by_strategy.values())

    @property
    def accepted_by_source(self) -> dict[str, int]:
        """Accepted drafts by source, over every batch size."""
        return dict(sum((Counter(by) for by in self.accepted_by_class.values()), Counter()))

    @property
    def accept_len_mean(self) -> float:
        return mean_accept_len(self.accept_lens)

    def summary(self) -> dict:
        accepted = self.accepted_by_source
        n = sum(self.accept_lens.values())
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0,
            "prefill_s": self.prefill_s,
            "decode_steps": self.decode_steps,
            "sd_steps": self.sd_steps,
            "sd_seconds": self.sd_seconds,
            "plain_seconds": self.plain_seconds,
            "catch_up_s": self.catch_up_s,
            "setup_s": self.setup_s,
            "by_strategy": {k: {**v, "accept_len": v["tokens"] / v["request_steps"]} for k, v in self.by_strategy.items()},
            "accept_len_mean": self.accept_len_mean,
            "accept_len_hist": {str(k): v for k, v in sorted(self.accept_lens.items())},
            "accept_rate_by_position": {str(d): c / n for d, c in sorted(self.depth_accepts.items())} if n else {},
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "by_source": {s: {"drafted": self.drafted_by_source.get(s, 0), "accepted": accepted.get(s, 0)}
                          for s in SOURCE_NAMES.values() if s in self.drafted_by_source},
            # accepted drafts per request-step, by batch-size class and source
            "accepted_by_batch_size": {c: {s: n / self.request_steps_by_class[c] for s, n in by.items()}
                                       for c, by in self.accepted_by_class.items()},
            "timeline": [[round(t, 5), n, arm] for t, n, arm in self.timeline],
        }


class Phases:
    """Wall time by phase of the engine's steps, for `tailtamer bench profile`: each `mark(name)`
    charges the time since the previous mark to `name`. Off (one attribute test per mark)
    unless a profile turns it on; on an accelerator a mark waits for the device first."""

    def __init__(self):
        self.on = False
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._last = 0.0
        self._sync = None

    def start(self, sync=None) -> None:
        self.on, self.seconds, self.counts, self._sync = True, {}, {}, sync
        self._last = time.perf_counter()

    def stop(self) -> dict[str, tuple[float, int]]:
        self.on = False
        return {k: (v, self.counts[k]) for k, v in self.seconds.items()}

    def mark(self, name: str) -> None:
        if not self.on:
            return
        if self._sync is not None:
            self._sync()
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self.counts[name] = self.counts.get(name, 0) + 1
        self._last = now


PHASES = Phases()
