"""Speculative decoding in the rollout: its config and the engine's speculator built from it."""

from __future__ import annotations

from dataclasses import dataclass

from tailtamer.config_fields import at_least, f
from tailtamer.errors import ConfigError
from tailtamer.model.drafter import load_drafter
from tailtamer.rollout.eagle import EagleProposer
from tailtamer.rollout.ngram import NgramProposer
from tailtamer.rollout.proposer import Proposer
from tailtamer.rollout.speculative import ACCEPTANCE_RULES, LOSSY_RULES, Strategy
from tailtamer.rollout.tuner import BEGTuner, FixedTuner

# BEG-MAB defaults: two real choices per tokens-to-verify group (fastrl's defaults have one,
# so its bandit never learns), buckets of batch sizes 1-2, 3-64 and 65+ (Strategy.verify
# 8/5/3), from `tailtamer bench sd` on the built-in base model: 4_1_5 is the best cell from
# batch 2 to 64, trees and deep chains pay most at batch 1 (README).
DEFAULT_MAB_STRATEGIES = ("4_2_8", "7_1_8", "4_1_5", "2_2_5", "2_1_3", "1_2_3")
DEFAULT_BUCKET_THRESHOLDS = (1, 3, 65)
# spec.bs_threshold when unset, on a GPU: there a large batch's verify forward is compute-bound,
# so SD pays only once few requests run (TLT switches SD on below 32). On a CPU the default is
# none: on the built-in base model SD pays at every batch size up to 512 (`bench rollout`).
GPU_BS_THRESHOLD = 64


@dataclass(frozen=True)
class SpecConfig:
    mode: str = f("off", "off, on (SD at every step, fixed strategy) or adaptive (SD in the long tail, tuned)")
    strategy: str = f("4_2_8", "DEPTH_TOPK_VERIFY draft tree for mode=on and tuner=fixed; DEPTH_TOPK_VERIFY@C drafts "
                               "only as deep as the drafter is confident (path probability C)")
    drafter: str | None = f(None, "an EAGLE drafter directory, or ngram (model-free); in train, builtin (the "
                                  "built-in base model's warm-up drafter)")
    acceptance: str = f("exact", "the acceptance rule; only the exact (lossless) one exists")
    bs_threshold: int | None = f(None, "adaptive: speculate once at most this many requests run (0 = never: the "
                                       "drafter is attached and trained, for measuring what it costs); unset: "
                                       f"{GPU_BS_THRESHOLD} on a GPU or with tuner=fixed, every batch size on a "
                                       "CPU (the bandit's 'no SD' arm decides)")
    tuner: str = f("beg", "adaptive: beg (the bucketed bandit of TLT §2.3, scoring arms by a confidence bound) or fixed")
    strategies: tuple[str, ...] = f(DEFAULT_MAB_STRATEGIES, "beg: the arms (plus 'no SD' in every bucket)")
    bucket_thresholds: tuple[int, ...] = f(DEFAULT_BUCKET_THRESHOLDS, "beg: one per tokens-to-verify group")
    epsilon: float = f(0.0, "beg: probability of a uniformly random arm (close to the paper's ε-greedy: 0.1 "
                            "with bonus 0)")
    window: int = f(60, "beg: an arm is judged by its rewards from the last this many steps of its batch-size "
                        "class (more than a bucket's arms); an arm with none left is tried again")
    bonus: float = f(1.0, "beg: confidence bonus c: an arm scores median · exp(c·σ/√n) over its n rewards in "
                          "the window, σ the class's measured spread of log rewards (0: greedy on the median)")
    seed: int = f(0, "beg: exploration randomness (never the sampling randomness)")
    compile: bool = f(False, "EAGLE: draft chains (DEPTH_1_VERIFY) as one torch.compile graph per batch size "
                             "1/2/4/8 and depth, each compiled when first needed (seconds; cached on disk) and "
                             "charged to no step; eager elsewhere and if compiling fails")

    def __post_init__(self):
        if self.mode not in ("off", "on", "adaptive"):
            raise ConfigError(f"spec.mode must be off, on or adaptive, got {self.mode!r}")
        if self.acceptance in LOSSY_RULES or self.acceptance not in ACCEPTANCE_RULES:
            raise ConfigError(f"spec.acceptance {self.acceptance!r} is refused: tailtamer only verifies "
                              f"losslessly ({', '.join(ACCEPTANCE_RULES)}); a relaxed rule would change "
                              f"what the policy samples")
        try:
            Strategy.parse(self.strategy)
        except ConfigError as e:
            raise ConfigError(f"spec.strategy: {e}") from None
        if self.mode != "off" and not self.drafter:
            raise ConfigError(f"spec.mode {self.mode} needs a drafter (spec.drafter): an EAGLE drafter directory or 'ngram'")
        if self.tuner not in ("beg", "fixed"):
            raise ConfigError(f"spec.tuner must be beg or fixed, got {self.tuner!r}")
        if self.bs_threshold is not None:
            at_least(self, "spec", 0, "bs_threshold")
        if self.compile and self.drafter == "ngram":
            raise ConfigError("spec.compile compiles an EAGLE drafter's draft chains; the ngram drafter has none")
        self._bandit()  # its settings are checked in every mode: a wrong one is a mistake even where unused
        if self.drafter == "ngram":  # it has no confidence to shape its drafts by: such an arm would be a twin
            for field, names in (("spec.strategy", [self.strategy]), ("spec.strategies", self.strategies)):
                shaped = [n for n in names if Strategy.parse(n).confidence]
                if shaped:
                    raise ConfigError(f"{field} {', '.join(shaped)}: the ngram drafter has no confidence to shape its "
                                      f"depth by (@); @ arms need an EAGLE drafter")

    def threshold(self, device_type: str) -> int | None:
        """The long-tail switch for a target on `device_type` (None: every batch size). Unset, a
        fixed strategy keeps the GPU's: it has no "no SD" arm to fall back on."""
        if self.bs_threshold is not None:
            return self.bs_threshold
        return None if device_type == "cpu" and self.tuner == "beg" else GPU_BS_THRESHOLD

    def most_verified(self, slots: int, device_type: str) -> int:
        """The most tokens one SD step verifies with `slots` requests running: every request's
        tree of the fixed strategy; with the bandit, per bucket its group's largest tree for as
        many requests as the bucket and the switch let run (rows the engine's logits hold)."""
        threshold = self.threshold(device_type) if self.mode == "adaptive" else None
        running = slots if threshold is None else min(slots, threshold)
        if self.mode == "on" or self.tuner == "fixed":
            return running * Strategy.parse(self.strategy).verify
        bandit, rows = self._bandit(), 0
        for i, group in enumerate(bandit.groups):
            low, high = bandit.bucket_sizes(i)
            if low <= running:
                top = running if high is None else min(high, running)
                rows = max(rows, top * max(s.verify for s in group))
        return rows

    def make_tuner(self):
        if self.mode == "on" or self.tuner == "fixed":
            return FixedTuner(Strategy.parse(self.strategy))
        return self._bandit()

    def _bandit(self):
        try:
            arms = [Strategy.parse(s) for s in self.strategies]
        except ConfigError as e:
            raise ConfigError(f"spec.strategies: {e}") from None
        return BEGTuner(arms, list(self.bucket_thresholds), self.epsilon, self.window, self.seed, self.bonus)


@dataclass
class Speculator:
    """What the engine needs to speculate: a proposer, a tuner that picks a strategy (or plain
    decoding) per step, and the long-tail switch (None: the tuner picks at every step)."""

    proposer: Proposer
    tuner: FixedTuner | BEGTuner
    bs_threshold: int | None = None

    def __post_init__(self):
        if self.bs_threshold is not None and self.bs_threshold < 0:
            raise ConfigError(f"spec.bs_threshold must be >= 0, got {self.bs_threshold}")

    @classmethod
    def fixed(cls, proposer: Proposer, strategy: str | Strategy) -> "Speculator":
        """SD at every step with one strategy."""
        return cls(proposer, FixedTuner(Strategy.parse(strategy) if isinstance(strategy, str) else strategy))


def make_speculator(spec: SpecConfig, target, drafter=None) -> Speculator | None:
    """The engine's speculator for `spec`; None when it is off. `drafter`: the EAGLE drafter
    already loaded (default: spec.drafter's)."""
    if spec.mode == "off":
        return None
    if spec.drafter == "ngram":
        proposer = NgramProposer()
    else:
        proposer = EagleProposer(drafter or load_drafter(spec.drafter, target), compiled=spec.compile)
    return Speculator(proposer, spec.make_tuner(), spec.threshold(target.device.type) if spec.mode == "adaptive" else None)
