"""Speculative decoding in the rollout: its config and the engine's speculator built from it."""

from __future__ import annotations

from dataclasses import dataclass

from tailtamer.config_fields import at_least, f
from tailtamer.errors import ConfigError
from tailtamer.model.drafter import load_drafter
from tailtamer.rollout.draft_history import BYTES_PER_TOKEN, DraftHistory
from tailtamer.rollout.eagle import EagleProposer
from tailtamer.rollout.fused import FusedProposer
from tailtamer.rollout.proposer import Proposer
from tailtamer.rollout.suffix import SuffixProposer
from tailtamer.rollout.speculative import ACCEPTANCE_RULES, LOSSY_RULES, Strategy
from tailtamer.rollout.tuner import BEGTuner, FixedTuner, entries, from_one_up, group_by_verify

# BEG-MAB defaults: two real choices per tokens-to-verify group (fastrl's defaults have one,
# so its bandit never learns), buckets of batch sizes 1-2, 3-64, 65-255 and 256+ (Strategy.verify
# 11/8/6/5): a deep chain and the same chain drafted only as deep as the drafter is confident.
# With coupled drafts and the two-level warm-up drafter, chains beat trees in every `bench sd`
# cell and deeper chains pay at every batch size to 64; on the default job (`bench train
# --steps 10 --repeats 3`, 2-core CPU) these arms gave a summed step of 1.67-1.73x against
# 1.56x with the former 4_2_8 7_1_8 | 4_1_5 2_2_5 | 2_1_3 1_2_3, the <=4-running tail
# 2.8x against 2.4x (docs/measurements.md). From 256 running a verify is compute-bound on a
# CPU core (6 tokens each of 512 requests cost 3x a plain step) and most requests are a few
# tokens from their end: a 4-deep chain there made `bench rollout` 4% faster than 5_1_6 (15
# interleaved rollouts, faster in 13). A default job's worker runs at most 64.
DEFAULT_MAB_STRATEGIES = ("10_1_11", "10_1_11@0.25", "7_1_8", "7_1_8@0.25", "5_1_6", "5_1_6@0.25", "4_1_5",
                          "4_1_5@0.25")
# The model-free drafter's: a match drafts as long as it goes, so the trees are deeper.
DEFAULT_SUFFIX_STRATEGIES = ("s16_2_17", "s16_1_17", "s8_2_9", "s8_1_9", "s4_2_5", "s4_1_5")
# Fused arms to add to the defaults' buckets (as wide as their groups: 11, 8, 6, 5 tokens), where
# siblings and earlier responses repeat each other: not in the defaults, since on the default
# job's arithmetic the siblings diverge fast and they do not pay (docs/speculative-decoding.md).
FUSED_ARMS = ("7_1_8+s3", "4_1_5+s3", "3_1_4+s2", "3_1_4+s1")
DEFAULT_BUCKET_THRESHOLDS = (1, 3, 65, 256)
# The default before the fourth bucket, which a run directory's config.yaml holds from then:
# read back as unset, so such a run resumes on the arms of today.
FORMER_DEFAULT_THRESHOLDS = (1, 3, 65)
# spec.bs_threshold when unset, on a GPU: there a large batch's verify forward is compute-bound,
# so SD pays only once few requests run (TLT switches SD on below 32). On a CPU the default is
# none: on the built-in base model SD pays at every batch size up to 512 (`bench rollout`).
GPU_BS_THRESHOLD = 64


@dataclass(frozen=True)
class SpecConfig:
    mode: str = f("off", "off, on (SD at every step, fixed strategy) or adaptive (SD in the long tail, tuned)")
    strategy: str | None = f(None, "the draft tree for mode=on and tuner=fixed: DEPTH_TOPK_VERIFY (EAGLE; @C drafts "
                                   "only as deep as the drafter is confident, path probability C), sD_K_N (the suffix "
                                   "drafter alone), D_K_N+sM (M suffix drafts fused into the EAGLE tree); unset: 4_2_8, "
                                   "with drafter=suffix s8_2_9")
    drafter: str | None = f(None, "an EAGLE drafter directory; suffix (model-free: the group's siblings, the request's "
                                  "own text, earlier responses to the prompt); ngram (vLLM's prompt lookup, "
                                  "rollout.backend=vllm only); in train, builtin (the built-in base model's warm-up "
                                  "drafter)")
    acceptance: str = f("exact", "the acceptance rule; only the exact (lossless) one exists")
    bs_threshold: int | None = f(None, "adaptive: speculate once at most this many requests run (0 = never: the "
                                       "drafter is attached and trained, for measuring what it costs); unset: "
                                       f"{GPU_BS_THRESHOLD} on a GPU or with tuner=fixed, every batch size on a "
                                       "CPU (the bandit's 'no SD' arm decides)")
    tuner: str = f("beg", "adaptive: beg (the bucketed bandit of TLT §2.3, scoring arms by a confidence bound) or fixed")
    strategies: tuple[str, ...] | None = f(None, "beg: the arms (plus 'no SD' in every bucket); unset: "
                                                  f"{', '.join(DEFAULT_MAB_STRATEGIES)}, with drafter=suffix "
                                                  f"{', '.join(DEFAULT_SUFFIX_STRATEGIES)}")
    bucket_thresholds: tuple[int, ...] | None = f(None, "beg: the fewest running requests of each bucket, one per "
                                                         "tokens-to-verify group (the widest first); unset: as many "
                                                         "of " + ", ".join(map(str, DEFAULT_BUCKET_THRESHOLDS))
                                                         + " as there are groups")
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
    history: int = f(8, "suffix drafts: earlier responses kept per prompt (by its tokens) to draft from in later "
                        "steps, saved with the checkpoint; 0: none")
    history_tokens: int = f(4_000_000, "suffix drafts: tokens the history keeps per worker (4 bytes each); the "
                                       "prompts answered longest ago go first")
    history_on_resume: str = f("load", "load (the checkpoint's history; a bad one stops the resume) or fresh (start "
                                       "with none; for that resume only: config.yaml keeps load)")

    def __post_init__(self):
        suffix = self.drafter == "suffix"
        if self.mode not in ("off", "on", "adaptive"):
            raise ConfigError(f"spec.mode must be off, on or adaptive, got {self.mode!r}")
        if self.acceptance in LOSSY_RULES or self.acceptance not in ACCEPTANCE_RULES:
            raise ConfigError(f"spec.acceptance {self.acceptance!r} is refused: tailtamer only verifies "
                              f"losslessly ({', '.join(ACCEPTANCE_RULES)}); a relaxed rule would change "
                              f"what the policy samples")
        try:
            Strategy.parse(self.fixed)
        except ConfigError as e:
            raise ConfigError(f"spec.strategy: {e}") from None
        if self.mode != "off" and not self.drafter:
            raise ConfigError(f"spec.mode {self.mode} needs a drafter (spec.drafter): an EAGLE drafter directory, or "
                              f"'suffix' ('ngram' on rollout.backend=vllm)")
        if self.tuner not in ("beg", "fixed"):
            raise ConfigError(f"spec.tuner must be beg or fixed, got {self.tuner!r}")
        if self.bs_threshold is not None:
            at_least(self, "spec", 0, "bs_threshold")
        if self.compile and self.drafter in ("suffix", "ngram"):
            raise ConfigError(f"spec.compile compiles an EAGLE drafter's draft chains; the {self.drafter} drafter has none")
        at_least(self, "spec", 0, "history")
        at_least(self, "spec", 1, "history_tokens")
        if self.history_on_resume not in ("load", "fresh"):
            raise ConfigError(f"spec.history_on_resume must be load or fresh, got {self.history_on_resume!r}")
        self._bandit()  # its settings are checked in every mode: a wrong one is a mistake even where unused
        if suffix:  # without an EAGLE drafter only the suffix index drafts
            for field, names in (("spec.strategy", [self.fixed]), ("spec.strategies", self.arms)):
                eagle = [n for n in names if not Strategy.parse(n).model_free]
                if eagle:
                    raise ConfigError(f"{field} {', '.join(eagle)}: the suffix drafter drafts sD_K_N arms (e.g. "
                                      f"s8_2_9); D_K_N and D_K_N+sM arms need an EAGLE drafter")

    @property
    def fixed(self) -> str:
        """spec.strategy, or its default for the drafter."""
        return self.strategy or ("s8_2_9" if self.drafter == "suffix" else "4_2_8")

    @property
    def arms(self) -> tuple[str, ...]:
        """spec.strategies, or the defaults for the drafter."""
        if self.strategies is not None:
            return self.strategies
        return DEFAULT_SUFFIX_STRATEGIES if self.drafter == "suffix" else DEFAULT_MAB_STRATEGIES

    @property
    def eagle(self) -> bool:
        """Whether an EAGLE drafter (a directory, not a model-free drafter) drafts."""
        return self.mode != "off" and self.drafter not in (None, "ngram", "suffix")

    @property
    def one_strategy(self) -> bool:
        """Whether one strategy drafts every SD step (mode on, or the fixed tuner): spec.strategy
        is what runs, not spec.strategies."""
        return self.mode == "on" or self.tuner == "fixed"

    @property
    def in_use(self) -> tuple[str, ...]:
        """The strategies this config may draft with: spec.strategy's, or the bandit's arms."""
        return (self.fixed,) if self.one_strategy else self.arms

    @property
    def in_use_field(self) -> str:
        """The field that names `in_use`, for messages about it."""
        return "spec.strategy" if self.one_strategy else "spec.strategies"

    def unread(self, filled: dict | None = None) -> list[str]:
        """spec.strategy, spec.strategies, spec.bs_threshold and spec.compile where set but not
        read in this mode, one line each:
        said at start-up, not refused, so that a run directory's config.yaml (written with
        spec.strategy=4_2_8 before it defaulted to unset) still resumes; `generate` refuses the
        flags instead. `filled`: values the config filled in itself (vLLM's `vllm_arms`), which
        the user did not set."""
        drafts = "spec.strategy" if self.one_strategy else "spec.strategies, the bandit's arms"
        reader = {"off": "spec.mode=off decodes without speculation", "on": "spec.mode=on drafts with spec.strategy",
                  "adaptive": f"spec.mode=adaptive with spec.tuner={self.tuner} drafts with {drafts}"}[self.mode]
        filled = filled or {}
        given = {"strategy": self.strategy, "strategies": self.strategies}
        read = self.in_use_field if self.mode != "off" else None
        lines = [f"spec.{name}={'[' + ','.join(value) + ']' if name == 'strategies' else value} is not read: {reader}"
                 for name, value in given.items()
                 if value is not None and f"spec.{name}" != read and value != filled.get(name)]
        if self.bs_threshold is not None and self.mode != "adaptive":
            lines.append(f"spec.bs_threshold={self.bs_threshold} is not read: it is spec.mode=adaptive's long-tail "
                         f"switch; {reader}")
        if self.compile and self.mode == "off":
            lines.append(f"spec.compile=true is not read: {reader}")
        return lines

    def uses_suffix(self) -> bool:
        """Whether an arm drafts from the suffix index (then the history is kept)."""
        return any((s := Strategy.parse(n)).model_free or s.suffix for n in self.in_use)

    def make_history(self, vocab_size: int, available: int | None, sharers: int = 1) -> DraftHistory | None:
        """The history the suffix index drafts from across rollouts, if an arm uses it; refused
        if its cap would not fit in half of `available` bytes (None: unknown), this worker's share
        of the machine's memory, which `sharers` workers share (each keeps a history of its own)."""
        if self.mode == "off" or not self.history or not self.uses_suffix():
            return None
        if available is not None and self.history_tokens * BYTES_PER_TOKEN > available // 2:
            has = (f"this machine has {available / 2 ** 30:.1f} GiB available" if sharers == 1 else
                   f"each of the {sharers} workers on this machine has {available / 2 ** 30:.1f} GiB of the "
                   f"machine's available memory and keeps a history of its own")
            raise ConfigError(f"spec.history_tokens={self.history_tokens} would hold "
                              f"{self.history_tokens * BYTES_PER_TOKEN / 2 ** 30:.1f} GiB of responses, over half "
                              f"of what it may use ({has}): lower spec.history_tokens")
        return DraftHistory(self.history, self.history_tokens, vocab_size)

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
        if self.one_strategy:
            return running * Strategy.parse(self.fixed).width
        bandit, rows = self._bandit(), 0
        for i, group in enumerate(bandit.groups):
            low, high = bandit.bucket_sizes(i)
            if low <= running:
                top = running if high is None else min(high, running)
                rows = max(rows, top * max(s.width for s in group))
        return rows

    def make_tuner(self):
        if self.one_strategy:
            return FixedTuner(Strategy.parse(self.fixed))
        return self._bandit()

    def _bandit(self):
        try:
            arms = [Strategy.parse(s) for s in self.arms]
        except ConfigError as e:
            raise ConfigError(f"spec.strategies: {e}") from None
        return BEGTuner(arms, self._thresholds(arms), self.epsilon, self.window, self.seed, self.bonus)

    def _thresholds(self, arms: list[Strategy]) -> list[int]:
        """spec.bucket_thresholds, or as many of the defaults as the arms form groups."""
        groups = len(group_by_verify(arms))
        if self.bucket_thresholds is not None:
            given = list(self.bucket_thresholds)
            if self.strategies is None and len(given) != groups and from_one_up(given):
                raise ConfigError(f"spec.bucket_thresholds has {entries(len(given))} but the default arms form "
                                  f"{groups} groups by tokens to verify: give {groups}, or leave it unset "
                                  f"({', '.join(map(str, DEFAULT_BUCKET_THRESHOLDS))})")
            return given
        if groups > len(DEFAULT_BUCKET_THRESHOLDS):
            raise ConfigError(f"spec.strategies form {groups} groups by tokens to verify, more than the "
                              f"{len(DEFAULT_BUCKET_THRESHOLDS)} default buckets: give spec.bucket_thresholds, "
                              f"one per group")
        return list(DEFAULT_BUCKET_THRESHOLDS[:groups])


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


def check_engine_drafter(spec: SpecConfig) -> None:
    """Our engine's drafters: an EAGLE directory or suffix; ngram is vLLM's."""
    if spec.mode != "off" and spec.drafter == "ngram":
        raise ConfigError("spec.drafter=ngram is vLLM's prompt lookup (rollout.backend=vllm); tailtamer's engine "
                          "drafts model-free with spec.drafter=suffix (siblings, the request's own text, earlier "
                          "responses)")


def make_speculator(spec: SpecConfig, target, drafter=None, history: DraftHistory | None = None) -> Speculator | None:
    """The engine's speculator for `spec`; None when it is off. `drafter`: the EAGLE drafter
    already loaded (default: spec.drafter's); `history`: earlier responses for the suffix
    index (`SpecConfig.make_history`: a training run's; one rollout has none)."""
    if spec.mode == "off":
        return None
    check_engine_drafter(spec)
    vocab = target.config.vocab_size
    wide = [n for n in spec.in_use if not (s := Strategy.parse(n)).model_free and s.topk > vocab]
    if wide:
        raise ConfigError(f"{spec.in_use_field} {', '.join(wide)}: a top-k above the model's {vocab} tokens (a draft "
                          f"node has at most {vocab} children)")
    if spec.drafter == "suffix":
        proposer = SuffixProposer(history)
    else:
        proposer = EagleProposer(drafter or load_drafter(spec.drafter, target), compiled=spec.compile)
        if spec.uses_suffix():
            proposer = FusedProposer(proposer, SuffixProposer(history))
    return Speculator(proposer, spec.make_tuner(), spec.threshold(target.device.type) if spec.mode == "adaptive" else None)
