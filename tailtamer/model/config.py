"""Model hyper-parameters, read from and written to Hugging Face `config.json` fields.

Three architectures are supported, all plain pre-norm decoders with RMSNorm, rotary
embeddings, grouped-query attention and a SwiGLU MLP:
  - `Qwen2ForCausalLM`: bias on q/k/v projections, none elsewhere.
  - `LlamaForCausalLM`: `attention_bias` (q/k/v/o) and `mlp_bias` flags, both usually off.
  - `Qwen3ForCausalLM`: an RMSNorm over each q and k head (`q_norm`, `k_norm`, before the
    rotation), an `attention_bias` flag (q/k/v/o, usually off) and an explicit `head_dim`.
Rotary frequencies are plain RoFormer ones (`rope_type` 'default') or Llama 3.1's scaled ones
('llama3').
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from tailtamer.errors import CheckpointError, ConfigError

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
ROPE_TYPES = ("default", "llama3")


# The rotary table is built for every position of the context (model/transformer.py): 2**24
# positions of a 128-wide head are 17 GB; the longest contexts of released models are ~10M.
MAX_POSITIONS = 2 ** 24


@dataclass(frozen=True)
class Llama3RopeScaling:
    """`rope_type: llama3` parameters (frozen and hashable: rotary tables are cached by them).
    Error messages start with the parameter's name, for the caller to prefix with its field's."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"high_freq_factor ({self.high_freq_factor}) must be greater than "
                              f"low_freq_factor ({self.low_freq_factor})")
        value = self.original_max_position_embeddings
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"original_max_position_embeddings must be a positive integer, got {value!r}")

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "llama3", **asdict(self)}

    @classmethod
    def from_hf(cls, rope: dict[str, Any], field: str) -> "Llama3RopeScaling":
        missing = [f.name for f in fields(cls) if f.name not in rope]
        if missing:
            raise ConfigError(f"{field} of rope_type 'llama3' is missing {', '.join(missing)}")
        try:
            return cls(**{f.name: rope[f.name] for f in fields(cls)})
        except ConfigError as e:
            raise ConfigError(f"{field}.{e}") from None


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    architecture: str = "Qwen2ForCausalLM"
    head_dim: int | None = None  # None: hidden_size // num_attention_heads (filled in)
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Llama and Qwen3: bias on q/k/v/o (Qwen2 always has q/k/v bias)
    mlp_bias: bool = False  # Llama only
    rope_scaling: Llama3RopeScaling | None = None  # None: rope_type 'default'
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported; choose one of {sorted(ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2 ** 31:
                raise ConfigError(f"{name} must be a positive integer below 2**31, got {value!r}")
        if self.max_position_embeddings > MAX_POSITIONS:
            raise ConfigError(f"max_position_embeddings must be at most {MAX_POSITIONS:,} (2**24), longer than any "
                              f"model's context: the rotary table holds that many positions; got "
                              f"{self.max_position_embeddings:,}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool)
                                          or self.head_dim <= 0):
            raise ConfigError(f"head_dim must be a positive integer, got {self.head_dim!r}")
        ids = [self.bos_token_id, self.pad_token_id] + (
            list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id])
        if any(i is not None and (not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size)
               for i in ids):
            raise ConfigError(f"bos_token_id, eos_token_id and pad_token_id must be token ids (integers in "
                              f"[0, vocab_size={self.vocab_size})), got {self.bos_token_id!r}, {self.eos_token_id!r}, "
                              f"{self.pad_token_id!r}")
        if self.mlp_bias and self.architecture != "LlamaForCausalLM":
            raise ConfigError(f"mlp_bias is a LlamaForCausalLM option; {self.architecture} has no MLP bias")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ConfigError(f"rope_scaling must be None or a Llama3RopeScaling, got {self.rope_scaling!r}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}) unless head_dim is given"
            )
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_size % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_size}")

    @property
    def head_size(self) -> int:
        return self.head_dim

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "Qwen2ForCausalLM" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.architecture != "Qwen2ForCausalLM" and self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "Qwen3ForCausalLM"

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def num_parameters(self) -> int:
        h, i, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        q, kv = self.num_attention_heads * self.head_size, self.num_key_value_heads * self.head_size
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        layer = attn + mlp + 2 * h + (2 * self.head_size if self.qk_norm else 0)
        return v * h * (1 if self.tie_word_embeddings else 2) + L * layer + h

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a `config.json` dict; `source` names the file in error messages."""
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs) \
                or not isinstance(raw.get("model_type", ""), str):
            raise CheckpointError(f"{source}: architectures must be a list of names and model_type a name, got "
                                  f"{archs!r}, {raw.get('model_type')!r}")
        by_type = {v: k for k, v in ARCHITECTURES.items()}
        arch = archs[0] if archs else by_type.get(raw.get("model_type", ""), raw.get("model_type"))
        if arch not in ARCHITECTURES:
            raise CheckpointError(
                f"{source}: architecture {arch!r} is not supported; tailtamer loads {sorted(ARCHITECTURES)}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise CheckpointError(f"{source}: missing required field(s) {', '.join(missing)}")
        # transformers 5 reads `rope_scaling` (4.x's name) first when a file has both
        rope_field = "rope_scaling" if raw.get("rope_scaling") is not None else "rope_parameters"
        rope = raw.get(rope_field) or {}
        if not isinstance(rope, dict):
            raise CheckpointError(f"{source}: rope_scaling / rope_parameters must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise CheckpointError(f"{source}: {rope_field}.rope_type {rope_type!r} is not supported; "
                                  f"supported: {', '.join(map(repr, ROPE_TYPES))}")
        if raw.get("quantization_config"):
            method = raw["quantization_config"].get("quant_method") if isinstance(raw["quantization_config"], dict) \
                else None
            raise CheckpointError(f"{source}: a quantized checkpoint (quantization_config"
                                  + (f": {method}" if method else "") + "); tailtamer trains and rolls out float "
                                  "weights: use the unquantized model")
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
        if raw.get("use_sliding_window"):
            raise CheckpointError(f"{source}: sliding-window attention is not supported")
        layer_types = raw.get("layer_types") or []
        if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
            raise CheckpointError(f"{source}: layer_types must all be 'full_attention' (sliding-window attention "
                                  f"is not supported), got {layer_types!r}")

        def number(name: str, default: float, where: dict = raw) -> float:
            value = where.get(name, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise CheckpointError(f"{source}: {name} must be a number, got {value!r}")
            return float(value)

        def flag(name: str, applies: bool = True) -> bool:
            value = raw.get(name, False)
            if not isinstance(value, bool):
                raise CheckpointError(f"{source}: {name} must be true or false, got {value!r}")
            return value and applies

        try:
            return cls(
                architecture=arch,
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=raw["num_attention_heads"],
                # unset (None) means one per attention head, as in transformers; 0 is a mistake to name
                num_key_value_heads=raw["num_attention_heads"] if raw.get("num_key_value_heads") is None
                else raw["num_key_value_heads"],
                # transformers' Qwen3Config defaults head_dim to 128, not hidden_size / heads
                head_dim=raw.get("head_dim", 128 if arch == "Qwen3ForCausalLM" else None),
                max_position_embeddings=raw.get("max_position_embeddings", 2048),
                rope_theta=number("rope_theta", number("rope_theta", 10000.0), rope),
                rope_scaling=Llama3RopeScaling.from_hf(rope, rope_field) if rope_type == "llama3" else None,
                rms_norm_eps=number("rms_norm_eps", 1e-6),
                tie_word_embeddings=flag("tie_word_embeddings"),
                attention_bias=flag("attention_bias", arch != "Qwen2ForCausalLM"),
                mlp_bias=flag("mlp_bias", arch == "LlamaForCausalLM"),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=raw.get("eos_token_id"),
                pad_token_id=raw.get("pad_token_id"),
            )
        except ConfigError as e:
            raise CheckpointError(f"{source}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """`config.json` fields that both transformers 4.x and 5.x read."""
        rope = self.rope_scaling.to_hf() if self.rope_scaling else {"rope_type": "default"}
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": ARCHITECTURES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_size,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": {**rope, "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.rope_scaling:  # where transformers 4.x (and SGLang on it) looks for the scaling
            out["rope_scaling"] = rope
        if self.architecture != "LlamaForCausalLM":
            out.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers)
        if self.architecture != "Qwen2ForCausalLM":
            out["attention_bias"] = self.attention_bias
        if self.architecture == "LlamaForCausalLM":
            out["mlp_bias"] = self.mlp_bias
        return out

    def replace(self, **changes) -> "ModelConfig":
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _preset(**kw) -> dict[str, Any]:
    return kw


# Sizes for `tailtamer init-model --preset NAME`; vocab_size is taken from the tokenizer.
PRESETS: dict[str, dict[str, Any]] = {
    # The built-in task's base model (tailtamer sft): deep and narrow, so that the one-layer
    # drafter costs ~8% of a target forward and verifying 8 tokens ~1.2x one (where SD pays),
    # and still trains in about 9 minutes on 2 CPU cores.
    "base": _preset(hidden_size=64, intermediate_size=192, num_hidden_layers=16,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    # The base model's twin for the vLLM backend: the same layers and parameter count, with
    # head size 32 (2 heads, 1 KV head), since vLLM's CPU attention runs no head size below 32.
    "base-vllm": _preset(hidden_size=64, intermediate_size=192, num_hidden_layers=16,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024),
    # Wide and shallow: the fastest model to build in tests.
    "tiny": _preset(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    "small": _preset(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096),
    # Qwen2.5-0.5B's shape (with whatever vocabulary the tokenizer has).
    "qwen2.5-0.5b": _preset(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                            rope_theta=1000000.0, tie_word_embeddings=True),
}


def preset_config(name: str, vocab_size: int, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    known = {f.name for f in fields(ModelConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise ConfigError(f"unknown model field(s) {sorted(unknown)}")
    return ModelConfig(vocab_size=vocab_size, **{**PRESETS[name], **overrides})
