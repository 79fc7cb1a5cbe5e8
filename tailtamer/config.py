"""Training configuration: frozen dataclasses with one-line help per field, loaded from YAML
plus dotted overrides (`tailtamer train cfg.yaml rl.lr=1e-6`), validated at start-up.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from tailtamer.config_fields import absolute_paths, at_least, at_most, f, positive, same_as
from tailtamer.device import TRAIN_DTYPES
from tailtamer.drafter.spot import SpotConfig
from tailtamer.errors import ConfigError
from tailtamer.model.dirs import check_run_model
from tailtamer.rl.grpo import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from tailtamer.rl.optim import LR_SCHEDULES
from tailtamer.rl.sharding import SHARDINGS
from tailtamer.rollout.backend import BACKENDS
from tailtamer.rollout.engine import EngineConfig
from tailtamer.rollout.speculator import FORMER_DEFAULT_THRESHOLDS, SpecConfig, check_engine_drafter
from tailtamer.rollout.vllm_backend import VLLM_MAX_TEMPERATURE, VLLMConfig, check_strategies, vllm_arms


class _YAML12Loader(yaml.SafeLoader):
    """YAML 1.2 scalars: `4_2_8` stays a string (a strategy, not the int 428), `1e-6` is a float
    (YAML 1.1 wants `1.0e-6`) and `on`/`off` are strings (spec.mode), not booleans."""


_INT, _FLOAT, _BOOL = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool"
_YAML12Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag not in (_INT, _FLOAT, _BOOL)]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YAML12Loader.add_implicit_resolver(_BOOL, re.compile(r"^(true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_YAML12Loader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(0|[1-9][0-9]*)$"), list("-+0123456789"))
_YAML12Loader.add_implicit_resolver(
    _FLOAT, re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$"),
    list("-+0123456789."))


def _mapping_without_duplicates(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


# A key given twice would silently drop the first section or value.
_YAML12Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def parse_yaml(text: str):
    return yaml.load(text, Loader=_YAML12Loader)


def yaml_error(e: yaml.YAMLError) -> str:
    """A YAML error on one line: the problem and where (YAML's own message spans several)."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


@dataclass(frozen=True)
class RunConfig:
    name: str | None = f(None, "run directory name under out_dir; empty = default (default-2, ... when taken)")
    out_dir: str = f("runs", "where run directories are written (~ is the home directory)")
    model: str | None = f(None, "policy model directory; empty = the built-in base model (tailtamer sft)")
    steps: int = f(40, "RL steps")
    eval_every: int = f(10, "greedy accuracy on the held-out split every N steps (0 = never)")
    save_every: int = f(10, "checkpoint every N steps (atomic; 0 = only at the end)")
    keep_checkpoints: int = f(2, "checkpoints kept: the newest N, plus the best by held-out accuracy")
    log_samples_every: int = f(10, "every N steps, the first sample of the first 4 prompts to samples.jsonl "
                                    "(and TensorBoard / W&B when on); 0 = never")
    seed: int = f(0, "seeds data order, sampling and initialisation (0 to 2**32 - 1)")
    max_bad_steps: int = f(3, "stop (with a checkpoint) after this many NaN/inf losses in a row")
    loggers: tuple[str, ...] = f((), "extra loggers besides metrics.jsonl: tensorboard, wandb (offline unless WANDB_MODE)")
    workers: int = f(0, "worker processes on this machine (0 = one per CPU core or GPU, at most one per prompt "
                        "of a step); torchrun sets them itself")
    dist_timeout_s: float = f(300.0, "a worker silent for this long in a collective stops the run (at least 1 s)")
    device: str | None = f(None, "cpu, cuda or cuda:N (each worker takes its own GPU); empty = cuda when this "
                                 "PyTorch sees a GPU, else cpu")
    shard: str = f("none", "the policy the update trains: none (whole on every worker) or fsdp (parameters, "
                           "gradients and AdamW state sharded over the workers with FSDP2; each worker keeps the "
                           "whole policy for its rollout engine)")
    dtype: str = f("auto", "precision of the policy's training forwards: auto (bfloat16 on a GPU that has it, "
                           "else float32), float32, bfloat16; weights and optimizer stay float32, log-probs float32")

    def __post_init__(self):
        if isinstance(self.out_dir, str):  # as the shell would: `run.out_dir=~/runs` (after `=`) or in YAML
            object.__setattr__(self, "out_dir", os.path.expanduser(self.out_dir))
            if self.out_dir.startswith("~"):
                raise ConfigError(f"run.out_dir {self.out_dir}: no such user's home directory")
        at_least(self, "run", 1, "steps", "keep_checkpoints")
        at_least(self, "run", 0, "eval_every", "save_every", "max_bad_steps", "workers", "log_samples_every", "seed")
        at_most(self, "run", 2 ** 32 - 1, "seed")  # what every library it seeds takes (NumPy's legacy seed: 32 bits)
        at_least(self, "run", 1, "dist_timeout_s")  # below a second the workers' rendezvous itself times out
        at_most(self, "run", 7 * 86400, "dist_timeout_s")
        if self.shard not in SHARDINGS:
            raise ConfigError(f"run.shard must be one of {', '.join(SHARDINGS)}, got {self.shard!r}")
        if self.dtype not in TRAIN_DTYPES:
            raise ConfigError(f"run.dtype must be one of {', '.join(TRAIN_DTYPES)}, got {self.dtype!r}")
        if self.name is not None and (not self.name or Path(self.name).name != self.name or self.name in (".", "..")):
            raise ConfigError(f"run.name must be a plain directory name inside run.out_dir, got {self.name!r}")


@dataclass(frozen=True)
class DataConfig:
    train: str = f("builtin", "prompts: 'builtin' (the arithmetic task) or a JSONL/parquet file")
    eval: str | None = f(None, "held-out prompts: a JSONL/parquet file or 'builtin' (held-out built-in problems); "
                               "default: builtin with data.train=builtin, else data.n_eval prompts (at most a "
                               "tenth) held out of the training file")
    n_builtin: int = f(4096, "built-in training problems")
    n_eval: int = f(64, "held-out prompts used per evaluation")
    max_prompt_tokens: int = f(256, "longer prompts are skipped (and counted), never truncated")
    prompt_key: str | None = f(None, "column holding the prompt (text or chat messages); default: prompt, messages, "
                                     "or a GSM8K question")
    answer_key: str | None = f(None, "column holding the answer; default: answer (GSM8K '#### N' gives N) or "
                                     "reward_model.ground_truth")

    def __post_init__(self):
        at_least(self, "data", 1, "n_builtin", "max_prompt_tokens")
        at_least(self, "data", 0, "n_eval")
        keys = [f"data.{k}" for k in ("prompt_key", "answer_key") if getattr(self, k) is not None]
        if keys and all(x in (None, "builtin") for x in (self.train, self.eval)):
            what = "name columns" if len(keys) > 1 else "names a column"
            raise ConfigError(f"{' and '.join(keys)} {what} of a prompts file; data.train=builtin reads none")


@dataclass(frozen=True)
class RolloutConfig:
    prompts_per_step: int = f(16, "prompts sampled per RL step")
    group_size: int = f(8, "samples per prompt (the GRPO group)")
    max_new_tokens: int = f(320, "response length limit")
    temperature: float = f(1.0, "sampling temperature (also used for the policy's log-probs)")
    top_p: float = f(1.0, "nucleus sampling")
    max_batch_size: int = same_as(EngineConfig, "max_batch_size")
    backend: str = f("tailtamer", "the rollout engine: tailtamer (our embedded engine) or vllm (one vLLM engine per "
                                  "worker, in the environment `make vllm-env` creates; README, 'vLLM')")

    def __post_init__(self):
        at_least(self, "rollout", 1, "prompts_per_step", "max_new_tokens", "max_batch_size")
        if self.group_size < 2:  # one check for 0 and 1 alike, which says why
            raise ConfigError(f"rollout.group_size must be >= 2, got {self.group_size}: every advantage "
                              f"({', '.join(ADVANTAGES)}) compares a sample with the others of its prompt, so one "
                              f"sample per prompt has advantage 0 and the policy never changes")
        if self.backend not in BACKENDS:
            raise ConfigError(f"rollout.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature must be > 0 for RL, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p must be in (0, 1], got {self.top_p}")


# rl.reward_weights at most (in size): a reward is capped at 1e18 (rl/rewards.py), and weighted,
# summed over the functions and a group's mean in float32 (at most 3.4e38), nothing overflows.
MAX_REWARD_WEIGHT = 1e12


@dataclass(frozen=True)
class RLConfig:
    advantage: str = f("grpo", f"advantage estimator: {', '.join(ADVANTAGES)}")
    policy_loss: str = f("ppo-clip", f"policy loss: {', '.join(POLICY_LOSSES)} (gspo: sequence-level ratio; "
                                      "use clip bounds ~3e-4/4e-4 and loss_agg=seq-mean-token-mean as in the paper)")
    loss_agg: str = f("token-mean", f"loss aggregation: {', '.join(AGGREGATIONS)}")
    lr: float = f(1e-4, "AdamW learning rate (peak, after warm-up)")
    lr_schedule: str = f("constant", f"after warm-up: {', '.join(LR_SCHEDULES)} (over run.steps)")
    min_lr_ratio: float = f(0.0, "linear / cosine: the final learning rate as a fraction of rl.lr")
    warmup: int = f(3, "linear warm-up steps (RL steps)")
    weight_decay: float = f(0.0, "AdamW weight decay")
    adam_beta1: float = f(0.9, "AdamW β1")
    adam_beta2: float = f(0.99, "AdamW β2")
    adam_eps: float = f(1e-8, "AdamW ε")
    clip_low: float = f(0.2, "PPO clip ε_low")
    clip_high: float = f(0.28, "PPO clip ε_high (DAPO clip-higher)")
    kl_coef: float = f(0.0, "KL penalty coefficient; > 0 loads a frozen reference model")
    kl_estimator: str = f("k3", f"KL estimator: {', '.join(KL_ESTIMATORS)}")
    entropy_coef: float = f(0.0, "entropy bonus coefficient")
    ppo_epochs: int = f(1, "passes over each rollout")
    # One optimizer step per rollout is on-policy (π_old is the update's own forward, no second
    # forward) and is TRL's GRPO default; on the default job it cut the update by 0.14 s a
    # step and held-out accuracy rose as with 2 (README, "RL training").
    minibatches: int = f(1, "optimizer steps per pass (random subsets of the step's samples)")
    micro_batch_size: int = f(32, "samples per forward; a minibatch accumulates gradients over its micro-batches")
    micro_batch_tokens: int = f(4096, "padded tokens per forward at most (long samples go fewer to a micro-batch)")
    grad_clip: float = f(1.0, "gradient norm clip")
    grad_checkpointing: bool = f(False, "recompute each decoder layer in backward instead of keeping its "
                                        "activations (less memory, ~1/3 more update compute)")
    # A sample of advantage 0 adds exactly 0 to the policy loss's gradient; on the default job
    # those are 40-50% of the samples and more of the tokens (all-wrong groups are the long ones).
    skip_zero_advantage: bool = f(True, "no forward+backward for samples of advantage exactly 0 (their policy-loss "
                                        "gradient is 0; their tokens still count in the loss normalisation); "
                                        "ignored, every sample computed, when kl_coef or entropy_coef > 0")
    dynamic_sampling: bool = f(False, "drop groups whose rewards all agree (DAPO)")
    overlong: str = f("none", "truncated responses: none, mask (no loss), or penalty (DAPO soft punishment)")
    overlong_buffer: int = f(64, "penalty: tokens before max_new_tokens where the penalty ramps to -1")
    reward: tuple[str, ...] = f(("auto",), "reward function(s), summed with reward_weights: auto (the built-in "
                                          "scorer for each row's data_source: math for gsm8k/MATH/..., the built-in "
                                          "task's for rows without one), builtin, math (math-verify), "
                                          "module:function, file.py:function")
    reward_weights: tuple[float, ...] = f((), "one weight per rl.reward function; empty = 1 each")
    reward_timeout_s: float = f(5.0, "a reward call taking longer scores 0 (counted)")

    def __post_init__(self):
        if isinstance(self.reward, str):  # RLConfig(reward="math") in code, as the loader reads rl.reward=math
            object.__setattr__(self, "reward", (self.reward,))
        if self.kl_estimator in ("k1", "kl") and self.kl_coef > 0:
            raise ConfigError(f"rl.kl_estimator {self.kl_estimator!r}: log π − log π_ref as a loss has a gradient of 0 "
                              f"in expectation (the tokens are drawn from π), so it would not hold the policy to the "
                              f"reference; choose k2 (the gradient of KL(π‖π_ref)) or k3 (of KL(π_ref‖π), verl's "
                              f"low_var_kl)")
        for name, registry in (("advantage", ADVANTAGES), ("policy_loss", POLICY_LOSSES), ("loss_agg", AGGREGATIONS),
                               ("kl_estimator", KL_ESTIMATORS), ("lr_schedule", LR_SCHEDULES)):
            if name == "kl_estimator" and self.kl_coef <= 0 and self.kl_estimator in ("k1", "kl"):
                continue  # unused; an older run's config.yaml may name it
            if getattr(self, name) not in registry:
                raise ConfigError(f"rl.{name} {getattr(self, name)!r} is unknown; choose one of {sorted(registry)}")
        if self.overlong not in ("none", "mask", "penalty"):
            raise ConfigError(f"rl.overlong must be none, mask or penalty, got {self.overlong!r}")
        positive(self, "rl", "lr", "grad_clip", "reward_timeout_s")
        at_most(self, "rl", 86400, "reward_timeout_s")
        at_least(self, "rl", 0, "kl_coef", "entropy_coef", "weight_decay", "warmup")
        at_least(self, "rl", 1, "ppo_epochs", "minibatches", "micro_batch_size", "micro_batch_tokens",
                 "overlong_buffer")
        if not 0 <= self.clip_low < 1:
            raise ConfigError(f"rl.clip_low must be in [0, 1), got {self.clip_low}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"rl.{name} must be in [0, 1), got {getattr(self, name)}")
        positive(self, "rl", "adam_eps")
        if not self.reward:
            raise ConfigError("rl.reward: give at least one reward function")
        if self.reward_weights and len(self.reward_weights) != len(self.reward):
            raise ConfigError(f"rl.reward_weights: {len(self.reward_weights)} weights for {len(self.reward)} reward "
                              f"functions (rl.reward={list(self.reward)})")
        heavy = [w for w in self.reward_weights if abs(w) > MAX_REWARD_WEIGHT]
        if heavy:  # weight x reward (up to 1e18) summed in float32 would overflow: every update skipped
            raise ConfigError(f"rl.reward_weights: {heavy[0]!r} is beyond +-{MAX_REWARD_WEIGHT:g} (weighted rewards "
                              f"are summed in float32); scale the weights down")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"rl.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        at_least(self, "rl", 0, "clip_high")

    @property
    def skips_zero_advantage(self) -> bool:
        """Exact only for the policy loss alone: a KL or entropy term has a gradient at A = 0."""
        return self.skip_zero_advantage and self.kl_coef == 0 and self.entropy_coef == 0


@dataclass(frozen=True)
class TrainConfig:
    run: RunConfig = f(RunConfig(), "run")
    data: DataConfig = f(DataConfig(), "data")
    rollout: RolloutConfig = f(RolloutConfig(), "rollout")
    rl: RLConfig = f(RLConfig(), "rl")
    spec: SpecConfig = f(SpecConfig(mode="adaptive", drafter="builtin"),
                         "speculative decoding in the rollout (drafter builtin = the built-in base model's warm-up drafter)")
    spot: SpotConfig = f(SpotConfig(), "the adaptive drafter's spot trainer: online training of spec.drafter on idle time")
    vllm: VLLMConfig = f(VLLMConfig(), "the vLLM engine, with rollout.backend=vllm")

    def __post_init__(self):
        if self.rollout.backend != "vllm":
            check_engine_drafter(self.spec)
        if self.rollout.backend == "vllm":
            check_strategies(self.spec)
            if self.rollout.temperature > VLLM_MAX_TEMPERATURE:
                raise ConfigError(f"rollout.temperature {self.rollout.temperature}: vLLM samples at temperatures up "
                                  f"to {VLLM_MAX_TEMPERATURE:g}")
        if self.rl.overlong == "penalty" and self.rl.overlong_buffer >= self.rollout.max_new_tokens:
            raise ConfigError(f"rl.overlong_buffer ({self.rl.overlong_buffer}) must be below rollout.max_new_tokens "
                              f"({self.rollout.max_new_tokens}): the penalty would hit every response")
        if self.rollout.prompts_per_step * self.rollout.group_size % self.rl.minibatches:
            raise ConfigError(f"rl.minibatches ({self.rl.minibatches}) must divide rollout.prompts_per_step x "
                              f"rollout.group_size "
                              f"({self.rollout.prompts_per_step * self.rollout.group_size})")
        if self.spec.drafter == "builtin" and self.run.model is not None and self.spec.mode != "off":
            model = Path(self.run.model)
            check_run_model(model)  # a broken model directory is the mistake to name first, not the drafter
            missing = [name for name in ("config.json", "tokenizer.json") if not (model / name).is_file()]
            if missing:
                raise ConfigError(f"run.model {model}: no {' or '.join(missing)}, so not a model directory")
            free = "ngram" if self.rollout.backend == "vllm" else "suffix"  # the model-free drafter it runs
            raise ConfigError(f"spec.drafter=builtin is the built-in base model's drafter (with run.model unset), not "
                              f"one for run.model={self.run.model}; give spec.drafter=DIR (tailtamer drafter train), "
                              f"spec.drafter={free}, or spec.mode=off")


def _coerce(value: Any, kind, where: str):
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = [k for k in typing.get_args(kind) if k is not type(None)]
        if value is None:
            return None
        if options[0] is not str and value in ("None", "none"):  # Python's spelling of YAML's null
            raise ConfigError(f"{where}: {value!r} is a string; write null (or nothing after =) to leave it unset")
        return _coerce(value, options[0], where)
    if origin is tuple:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # `rl.reward=math`: a list of one
        if isinstance(value, dict) and len(value) == 1 and None in value.values():  # YAML read `x.py:` as a mapping
            raise ConfigError(f"{where}: {next(iter(value))}: has nothing after ':' (module:function or "
                              f"file.py:function)")
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = typing.get_args(kind)[0]
        return tuple(_coerce(v, inner, where) for v in value)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if kind in (int, str) and isinstance(value, kind) and not isinstance(value, bool):
        return value
    raise ConfigError(f"{where}: expected {getattr(kind, '__name__', kind)}, got {value!r}{_yaml_reading(value)}")


def _yaml_reading(value) -> str:
    """Why YAML gave `value` where the user typed a string: what to write instead."""
    if value is None:
        return " (YAML reads ~ and an empty value as null: quote a value, e.g. '~/runs')"
    if isinstance(value, dict) and len(value) == 1 and None in value.values():
        return f" (YAML reads '{next(iter(value))}:' as a mapping: quote the value)"
    return ""


# Old name -> new name, so a config written for an older tailtamer gets a hint, not a guess.
RENAMED = {"drafter": "spot"}  # the spot trainer's section; spec.drafter is the drafter itself


def from_dict(cls, data: dict | None, where: str = "", base=None):
    """Build a (nested) config dataclass, naming the dotted path of any unknown or bad field.
    Fields not in `data` keep their value in `base` (default: the class defaults), so a
    section given in part keeps the enclosing config's default for the rest (the default
    job's spec.mode stays adaptive when only spec.bs_threshold is set)."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for fl in fields(cls):
        if fl.name not in data:
            continue
        value, path = data.pop(fl.name), f"{where}{fl.name}"
        kind = hints[fl.name]
        if is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: expected a section (mapping), got {value!r}")
            section = getattr(base, fl.name) if base is not None else _field_default(fl)
            kwargs[fl.name] = from_dict(kind, value, f"{path}.", section)
        else:
            kwargs[fl.name] = _coerce(value, kind, path)
    renamed = [f"{where}{k} is now {where}{RENAMED[where + k]}" for k in data if where + k in RENAMED]
    if renamed:
        raise ConfigError(f"renamed config field(s): {'; '.join(renamed)} (rename it in the config file or override)")
    if data:
        names = [fl.name for fl in fields(cls)]
        close = [f"{where}{m[0]}" for k in data if (m := difflib.get_close_matches(k, names, n=1))]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown config field(s) {', '.join(where + k for k in data)}{hint}; "
                          f"known here: {', '.join(names)}")
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def _field_default(fl):
    return fl.default if fl.default is not dataclasses.MISSING else fl.default_factory()


def to_dict(cfg) -> dict:
    """Plain nested dict (tuples as lists) for YAML."""
    out = {}
    for fl in fields(cfg):
        value = getattr(cfg, fl.name)
        out[fl.name] = to_dict(value) if is_dataclass(value) else list(value) if isinstance(value, tuple) else value
    return out


def apply_override(data: dict, item: str) -> None:
    """Apply `a.b.c=value` (value parsed as YAML) to a nested dict."""
    if "=" not in item:
        first = item.endswith((".yaml", ".yml")) or Path(item).is_file()
        raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. rl.lr=1e-6)"
                          + ("; a config file goes first: tailtamer train FILE KEY=VALUE ..." if first else ""))
    key, raw = item.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {item!r} has no field name before '=' (e.g. rl.lr=1e-6)")
    try:
        value = parse_yaml(raw) if raw != "" else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: cannot parse the value ({yaml_error(e)})") from None
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
    node[parts[-1]] = value


def load_train_config(path: str | Path | None = None, overrides: list[str] = (), written: bool = False) -> TrainConfig:
    """The config of a YAML file (or the default job) with dotted overrides, the files it names
    as absolute paths (`absolute_paths`). `written`: the
    file is a run directory's own config.yaml, which an older tailtamer may have written with
    since-renamed sections or former defaults; those are read under their new names and as
    unset (a user's file gets a hint)."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"{path} is a directory, not a config file (a run directory resumes with --resume)")
        if not path.is_file():
            section = str(path).split(".")[0]
            key = section in {x.name for x in fields(TrainConfig)} and path.suffix not in (".yaml", ".yml", ".json")
            hint = f" (an override is KEY=VALUE: {path}=...)" if key else ""
            raise ConfigError(f"{path}: config file not found{hint}")
        try:
            data = parse_yaml(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: malformed YAML ({yaml_error(e)})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not valid UTF-8 (byte {e.start + 1})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
        if written:
            data = {RENAMED.get(k, k) if RENAMED.get(k) not in data else k: v for k, v in data.items()}
            spec = data.get("spec")
            if isinstance(spec, dict) and spec.get("strategies") is None and \
                    spec.get("bucket_thresholds") == list(FORMER_DEFAULT_THRESHOLDS):
                spec["bucket_thresholds"] = None  # the default arms' thresholds of its day: today's follow today's arms
        data = {k: {} if v is None else v for k, v in data.items()}  # `run:` with every key commented out
    in_file = copy.deepcopy(data)
    for item in overrides:
        try:
            apply_override(data, item)
        except ConfigError:  # an override into a section the file broke: the file is what to fix
            error = _file_error(in_file) if path is not None and _into_broken_section(in_file, item) else None
            if error is not None:
                raise ConfigError(f"{path}: {error}") from None
            raise
    try:
        return _train_config(data)
    except ConfigError as e:
        # the file is named only for what it gets wrong by itself: blamed for a bad value given on
        # the command line (to a resumed run's config.yaml, say), it would send the user to edit
        # a file that is fine
        blame = path is not None and (not overrides or str(_file_error(in_file)) == str(e))
        raise ConfigError(f"{path}: {e}" if blame else str(e)) from None


def _file_error(data: dict) -> ConfigError | None:
    """What `data`, a config file alone, gets wrong (None: nothing)."""
    try:
        _train_config(data)
    except ConfigError as e:
        return e
    return None


def _into_broken_section(data: dict, item: str) -> bool:
    """Whether override `item` (KEY=VALUE) goes through a section that `data` holds as no mapping."""
    node = data
    for part in item.split("=", 1)[0].strip().split(".")[:-1]:
        node = node.get(part, {})
        if not isinstance(node, dict):
            return True
    return False


def _train_config(data: dict) -> TrainConfig:
    """The TrainConfig of a parsed config with its overrides applied (vLLM's default arms filled in
    where rollout.backend=vllm leaves them unset)."""
    if isinstance(data.get("rollout"), dict) and data["rollout"].get("backend") == "vllm" and \
            isinstance(data.setdefault("spec", {}), dict):
        for name, value in vllm_arms(data["spec"].get("drafter")).items():
            if data["spec"].get(name) is None:  # absent, or null as a run's config.yaml writes it
                data["spec"][name] = list(value) if isinstance(value, tuple) else value
    return from_dict(TrainConfig, absolute_paths(data))


REFERENCE_COMMAND = "tailtamer train --help-config markdown > docs/config.md"


def config_reference() -> str:
    """docs/config.md: every field of the default job's config, by section, with its default
    and help (`REFERENCE_COMMAND` writes it; a test keeps it current)."""
    lines = ["# Configuration reference", "",
             f"Generated from the config's own help texts (`{REFERENCE_COMMAND}`; a test fails when it is out of",
             "date). Defaults are the built-in default job's. Set a field in a YAML file of sections",
             "(`tailtamer train job.yaml`) or on the command line (`tailtamer train rl.lr=1e-6 spec.mode=off`);",
             "a run writes the resolved config to `runs/NAME/config.yaml`. Unknown fields and bad values are",
             "refused at start-up with one line."]
    section = None
    for line in config_help():
        name, rest = line.split(" = ", 1)
        default, help_text = rest.split("    ", 1)
        if name.split(".")[0] != section:
            section = name.split(".")[0]
            lines += ["", f"## {section}", "", "| field | default | what it sets |", "|---|---|---|"]
        lines.append(f"| `{name}` | `{default}` | {help_text.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def config_help(cfg=None, where: str = "") -> list[str]:
    """`field = default    help` for every field, with the defaults of the built-in job
    (`TrainConfig()`, whose sections differ from their classes' own defaults)."""
    cfg = TrainConfig() if cfg is None else cfg
    lines = []
    for fl in fields(cfg):
        value = getattr(cfg, fl.name)
        if is_dataclass(value):
            lines += config_help(value, f"{where}{fl.name}.")
        else:
            shown = "null" if value is None else repr(value)  # as a config file or key=value writes it
            lines.append(f"{where}{fl.name} = {shown}    {fl.metadata.get('help', '')}")
    return lines
