"""Hugging Face model directories in and out: `config.json` + `model.safetensors` (+
`generation_config.json`).

Our parameter names are transformers' without the `model.` prefix (`lm_head` keeps its name),
so a directory written here loads in `AutoModelForCausalLM` and gives the same logits.

A model stops on the end-of-sequence ids of config.json and of generation_config.json, in
that order: chat models often name their turn end only in the latter (Qwen2.5-Instruct's
config.json has <|im_end|>; its generation_config.json adds <|endoftext|>).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tailtamer.atomic import atomic_write, atomic_write_json
from tailtamer.errors import CheckpointError, ConfigError
from tailtamer.model.config import ModelConfig
from tailtamer.model.dirs import check_model_dir
from tailtamer.model.tokenizer import load_tokenizer
from tailtamer.model.transformer import Transformer, join_fused, split_fused

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise CheckpointError(f"dtype {name!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def to_hf_key(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def from_hf_key(name: str) -> str:
    return name.removeprefix("model.")


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: {what} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed JSON ({e})") from None


def token_ids(value) -> list[int] | None:
    """An id or a list of ids as a list; None for anything else."""
    ids = value if isinstance(value, list) else [value]
    return ids if all(isinstance(i, int) and not isinstance(i, bool) for i in ids) else None


def read_generation_config(model_dir: Path) -> dict:
    """generation_config.json's fields (none without one), its eos_token_id checked."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    raw = read_json(path, "generation_config.json")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    eos = raw.get("eos_token_id")
    if eos is not None and token_ids(eos) is None:
        raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of token ids, got {eos!r}")
    return raw


def with_generation_eos(cfg: ModelConfig, generation: dict, source: Path) -> ModelConfig:
    """`cfg` stopping on generation_config.json's end-of-sequence ids too (after its own)."""
    ids = list(dict.fromkeys(cfg.eos_ids + tuple(token_ids(generation.get("eos_token_id")) or ())))
    if ids == list(cfg.eos_ids):
        return cfg
    try:
        return cfg.replace(eos_token_id=ids[0] if len(ids) == 1 else ids)
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None


def read_configs(model_dir: str | Path) -> tuple[ModelConfig, dict]:
    """The model's config (with every stop id) and its generation_config.json fields."""
    model_dir = Path(model_dir)
    check_model_dir(model_dir)
    path = model_dir / "config.json"
    cfg = ModelConfig.from_hf(read_json(path, "config.json"), source=str(path))
    generation = read_generation_config(model_dir)
    return with_generation_eos(cfg, generation, model_dir / "generation_config.json"), generation


def load_config(model_dir: str | Path) -> ModelConfig:
    return read_configs(model_dir)[0]


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Single-file or sharded (`model.safetensors.index.json`) weights."""
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    files = [single] if single.is_file() else []
    if not files and index.is_file():
        spec = read_json(index, "safetensors index")
        weight_map = spec.get("weight_map") if isinstance(spec, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: expected an object with a weight_map of tensor name -> shard file")
        names = sorted(set(weight_map.values()))
        if any(Path(name).name != name for name in names):
            raise CheckpointError(f"{index}: shard names must be files of the model directory, got {names[:3]}")
        files = [model_dir / name for name in names]
    if not files:
        raise CheckpointError(f"{model_dir}: no model.safetensors (or model.safetensors.index.json)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            shard = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
        if f != single:  # each tensor from the shard the index names (a stray copy elsewhere would win by order)
            elsewhere = [k for k in shard if weight_map.get(k, f.name) != f.name]
            absent = [k for k, v in weight_map.items() if v == f.name and k not in shard
                      and not k.endswith(IGNORED_SUFFIXES)]
            if elsewhere or absent:
                raise CheckpointError(f"{index}: its weight_map does not match {f.name}: " + "; ".join(
                    what for what in (elsewhere and f"{f.name} holds {', '.join(elsewhere[:3])}, mapped to another "
                                                    f"shard", absent and f"{f.name} lacks {', '.join(absent[:3])}")
                    if what))
        tensors.update(shard)
    return tensors


def weights_source(model_dir: Path) -> Path:
    """The file that names a model directory's weights in errors: model.safetensors, or the
    index of a sharded checkpoint."""
    single = model_dir / "model.safetensors"
    return single if single.is_file() or not (model_dir / "model.safetensors.index.json").is_file() \
        else model_dir / "model.safetensors.index.json"


# Buffers some older checkpoints carry, which a model recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_state_dict(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], source: str) -> None:
    """Raise naming every missing, unexpected (the config describes a different model) and
    misshapen tensor (at most a few of each)."""
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected and not k.endswith(IGNORED_SUFFIXES)]
    wrong = [f"{k}: expected {tuple(expected[k].shape)}, got {tuple(got[k].shape)}"
             for k in expected if k in got and got[k].shape != expected[k].shape]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:5])}"
                        + (" ..." if len(missing) > 5 else ""))
    if wrong:
        problems.append(f"wrong shape for {len(wrong)} tensor(s): {'; '.join(wrong[:5])}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) the config does not describe: {', '.join(unexpected[:5])}"
                        + (" ..." if len(unexpected) > 5 else ""))
    if problems:
        raise CheckpointError(f"{source}: " + " | ".join(problems))


# The weights' dtypes a checkpoint may hold: they load as the run's dtype. Integers, booleans
# and float8 are quantized or damaged weights (copying them into float parameters would give a
# different model without a word).
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_finite(tensors: dict[str, torch.Tensor], source: str) -> None:
    """Weights of a float dtype, without NaN or inf, which would sample garbage (or crash
    inside multinomial) later on."""
    other = [f"{k} ({str(v.dtype).removeprefix('torch.')})" for k, v in tensors.items() if v.dtype not in WEIGHT_DTYPES]
    if other:
        raise CheckpointError(f"{source}: {len(other)} tensor(s) not of a float dtype tailtamer loads (float32, "
                              f"bfloat16, float16, float64): {', '.join(other[:5])}" + (" ..." if len(other) > 5 else "")
                              + "; a quantized checkpoint must be dequantized first")
    bad = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"{source}: non-finite values (NaN or inf) in {len(bad)} tensor(s): "
                              f"{', '.join(bad[:5])}" + (" ..." if len(bad) > 5 else ""))


def check_tokenizer_fits(tokenizer, cfg: ModelConfig, model_dir: str | Path) -> None:
    """Every id the tokenizer can produce must have an embedding row."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{Path(model_dir) / 'tokenizer.json'}: {tokenizer.vocab_size} token ids but the model's "
                              f"vocab_size is {cfg.vocab_size} (config.json): ids from {cfg.vocab_size} on have "
                              f"no embedding")


def load_pretrained(model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"):
    """(model, tokenizer) of a model directory, checked to fit each other."""
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, dtype, device)
    check_tokenizer_fits(tokenizer, model.config, model_dir)
    return model, tokenizer


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu") -> Transformer:
    model_dir, dtype = Path(model_dir), parse_dtype(dtype)
    cfg, generation = read_configs(model_dir)
    model = model_from_hf_state(cfg, read_safetensors(model_dir), dtype, device, weights_source(model_dir),
                                model_dir / "config.json")
    model.generation_config = generation
    return model


def model_from_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device,
                        source: str | Path, config_source: str | Path) -> Transformer:
    """Our Transformer of `cfg` holding a copy of a transformers state dict (its key names),
    checked: its layers, names, shapes and values; `source` and `config_source` name the
    weights and the config in errors."""
    raw = {from_hf_key(k): v for k, v in state.items()}
    layers = {int(k.split(".")[1]) for k in raw if k.startswith("layers.") and k.split(".")[1].isdigit()}
    if len(layers) != cfg.num_hidden_layers:  # before building a model of the config's size
        raise CheckpointError(f"{config_source}: num_hidden_layers is {cfg.num_hidden_layers} but {Path(source).name} "
                              f"holds {len(layers)} layer(s)")
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = split_fused(model.state_dict(), cfg)
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        raw.pop("lm_head.weight", None)
    check_state_dict(expected, raw, f"{source}")
    check_finite(raw, f"{source}")
    # in the final dtype before loading, so that each weight is rounded once (a float64
    # checkpoint loaded as float64 stays exact)
    model = model.to_empty(device=device).to(dtype)
    model.load_state_dict(join_fused(raw, cfg), strict=False, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def save_model(model: Transformer, model_dir: str | Path) -> None:
    """Write config.json, model.safetensors (float32, or the model's dtype if wider) and
    generation_config.json: the one the model was loaded with (its sampling defaults are for
    whoever serves the model next) with every stop id."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    store = torch.float64 if model.dtype == torch.float64 else torch.float32
    tensors = {to_hf_key(k): v.detach().to("cpu", store).contiguous()
               for k, v in split_fused(model.state_dict(), cfg).items()
               if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    atomic_write(model_dir / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    hf = cfg.to_hf()
    hf["torch_dtype"] = "float64" if store == torch.float64 else "float32"
    atomic_write_json(model_dir / "config.json", hf)
    ids = {k: hf[k] for k in ("bos_token_id", "pad_token_id") if hf[k] is not None}
    atomic_write_json(model_dir / "generation_config.json",
                      {**ids, **model.generation_config, "eos_token_id": cfg.eos_token_id})


def init_weights_(module: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random init as transformers does: normal(0, std) weights, zero biases, unit norms."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def init_model(cfg: ModelConfig, seed: int = 0, std: float = 0.02, perturb: float = 0.0) -> Transformer:
    """A random model; `perturb` > 0 adds normal(0, perturb) noise to the norms and biases
    (tests and checks, so that their handling is exercised: at 1 and 0 a wrong bias or a
    swapped norm would go unseen)."""
    model = Transformer(cfg)
    init_weights_(model, seed, std)
    if perturb:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias") or "norm" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * perturb)
    return model.eval()
