"""EAGLE one-layer drafter (Li et al. 2024, EAGLE / EAGLE-2; TLT §2.1).

    ĥ_{t+1} = Layer(fc([embed(x_{t+1}); h_t]))        logits_{t+2} = lm_head(ĥ_{t+1})

h_t is the target's final (post-norm) hidden state at position t. The embedding and LM head
are the target's own modules, held by reference: frozen, never trained, never saved. The one
decoder layer has no input norm (its input is already a mix of normalised features) and
there is no final norm, as in EAGLE and SGLang's `LlamaForCausalLMEagle` /
`Qwen2ForCausalLMEagle`.

Drafter architecture by target (`EAGLE_ARCHITECTURES`; the drafter's layer is the loader's):
  Qwen2ForCausalLM -> Qwen2ForCausalLMEagle   a Qwen2 layer (q/k/v bias)
  LlamaForCausalLM -> LlamaForCausalLMEagle   a Llama layer (the target's attention/MLP bias flags)
  Qwen3ForCausalLM -> LlamaForCausalLMEagle   a Llama layer: no q_norm / k_norm, the target's
                                              head_dim, attention_bias and rotary settings
Why Llama for Qwen3: the EAGLE authors and SpecForge draft with a Llama-architecture model
whatever the target (SafeAILab/EAGLE#307; the Qwen3 drafters listed in vllm-project/vllm#22333
are all Llama ones), and SGLang's one-layer EAGLE loaders, `llama_eagle.py` and
`qwen2_eagle.py`, read this layout (`fc.*`, `layers.0.*`; the Llama layer takes
`attention_bias` and `head_dim` from config.json). The `Qwen3ForCausalLMEagle` in one SGLang snapshot (qwen3_eagle.py)
is another layout (its projection is `eagle_fc`, its layer has q/k norms).

Drafter directories (the SGLang EAGLE layout):
  config.json        the target's config with `architectures: [<Arch>Eagle]` (and the layer's
                     model_type), num_hidden_layers 1 and `qkv_bias` (EAGLE's reference code
                     reads it; SGLang's Qwen2 layer always has the bias, its Llama layer reads
                     `attention_bias`)
  model.safetensors  fc.weight (H, 2H), fc.bias (H) unless the drafter has none (vLLM's EAGLE
                     loader has no fc bias: `fc_bias=False`), layers.0.self_attn.{q,k,v,o}_proj.*,
                     layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight
                     (no `model.` prefix, no embed_tokens, no lm_head: SGLang shares the target's)
Pair convention: drafter row j holds (h_j, x_{j+1}) at rotary position j and predicts h_{j+1}.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tailtamer.atomic import atomic_write, atomic_write_json
from tailtamer.errors import CheckpointError
from tailtamer.model.config import ModelConfig
from tailtamer.model.io import check_finite, check_state_dict, init_weights_, read_json, read_safetensors
from tailtamer.model.draft_step import DraftStep
from tailtamer.model.transformer import DecoderLayer, KVCache, Transformer, decode_inputs, join_fused, rotary, split_fused

EAGLE_ARCHITECTURES = {"Qwen2ForCausalLM": "Qwen2ForCausalLMEagle", "LlamaForCausalLM": "LlamaForCausalLMEagle",
                       "Qwen3ForCausalLM": "LlamaForCausalLMEagle"}
SHARED_PREFIXES = ("embed_tokens.", "lm_head.", "model.embed_tokens.")
# The drafter runs with the target's own values of these: a drafter trained with others would
# be silently wrong.
MATCHING_FIELDS = ("architecture", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps", "attention_bias",
                   "mlp_bias")


def eagle_config(target_cfg: ModelConfig) -> ModelConfig:
    """The drafter's config for a target: one layer, of its EAGLE loader's architecture."""
    layer = EAGLE_ARCHITECTURES[target_cfg.architecture].removesuffix("Eagle")
    return target_cfg.replace(num_hidden_layers=1, architecture=layer)


class Drafter(nn.Module):
    def __init__(self, target: Transformer, fc_bias: bool = True):
        """`fc_bias`: EAGLE's fc has a bias, vLLM's EAGLE-1 loader (llama_eagle.py) has none, so
        a drafter meant for vLLM is trained without one (`rollout/vllm_backend.py`)."""
        super().__init__()
        cfg = target.config
        self.config = eagle_config(cfg)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        layer = DecoderLayer(self.config)
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])
        self.attach(target)

    def attach(self, target: Transformer) -> None:
        """Share `target`'s embedding and LM head (by reference, outside this module's
        parameters, so no optimizer, state_dict or checkpoint of the drafter ever sees them)."""
        check_fits(self.config, target.config, "drafter")
        self.__dict__["_target"] = target

    @property
    def target(self) -> Transformer:
        return self.__dict__["_target"]

    def step(self, rebuild: bool = False) -> DraftStep:
        """The inference step (`DraftStep`), its weights current with this drafter's
        (`rebuild`: derive them again even if no parameter looks changed)."""
        if "_step" not in self.__dict__:
            self.__dict__["_step"] = DraftStep(self)
        return self.__dict__["_step"].refresh(rebuild)

    def forward(self, input_ids, hidden, positions=None, attn_mask=None):
        """Training pass over pairs (hidden[:, j], input_ids[:, j]) = (h_j, x_{j+1})."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.fc(torch.cat((self.target.embed_tokens(input_ids), hidden.to(self.fc.weight.dtype)), dim=-1))
        cos, sin = rotary(self.config, positions, x.dtype)
        x = self.layers[0](x, cos, sin, None if attn_mask is None else attn_mask[:, None])
        return self.target.lm_head(x), x

    def decode(self, input_ids, hidden, cache: KVCache, slots, starts, positions=None, tree_mask=None, span=None,
               last=None):
        """Logits and features of every pair (B, q, ·), or with `last` (B,) of pair last[b] of
        each row only (B, ·): the LM head then runs on those rows alone."""
        positions, mask, view = decode_inputs(input_ids, cache, slots, starts, positions, tree_mask, span)
        cos, sin = rotary(self.config, positions, cache.dtype)
        x = self.step().forward(input_ids, hidden, cos, sin, mask, cache.kv[0], view)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last]
        return self.target.lm_head(x), x

    def draft_chain(self, *args, **kwargs) -> torch.Tensor:
        """`DraftStep.draft_chain` with this drafter's current weights."""
        return self.step().draft_chain(*args, **kwargs)

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        return KVCache(self.config, slots, max_len, self.fc.weight.device, self.fc.weight.dtype)


def check_fits(drafter_cfg: ModelConfig, target_cfg: ModelConfig, source: str) -> None:
    expected = eagle_config(target_cfg)
    wrong = [f"architecture: drafter {EAGLE_ARCHITECTURES[drafter_cfg.architecture]} but a "
             f"{target_cfg.architecture} target takes {EAGLE_ARCHITECTURES[target_cfg.architecture]}"
             if f == "architecture" else f"{f}: drafter {getattr(drafter_cfg, f)} vs target {getattr(expected, f)}"
             for f in MATCHING_FIELDS if getattr(drafter_cfg, f) != getattr(expected, f)]
    if wrong:
        raise CheckpointError(f"{source} does not fit the target model: " + "; ".join(wrong))


def init_drafter(target: Transformer, seed: int = 0, std: float = 0.02, fc_bias: bool = True) -> Drafter:
    drafter = Drafter(target, fc_bias)
    init_weights_(drafter, seed, std)
    return drafter.to(device=target.device, dtype=target.dtype)


def drafter_tensors(drafter: Drafter) -> dict[str, torch.Tensor]:
    """A float32 CPU copy of the drafter's own (trainable) tensors: never the shared ones."""
    tensors = {k: v.detach().to("cpu", torch.float32, copy=True).contiguous()
               for k, v in split_fused(drafter.state_dict(), drafter.config).items()}
    assert not any(k.startswith(SHARED_PREFIXES) for k in tensors)  # shared by reference only
    return tensors


def write_drafter(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path) -> None:
    """Write a drafter directory from `drafter_tensors` (safe in a background thread)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    hf = cfg.to_hf()
    hf["architectures"] = [EAGLE_ARCHITECTURES[cfg.architecture]]
    hf["qkv_bias"] = cfg.qkv_bias
    atomic_write_json(out_dir / "config.json", hf)


def save_drafter(drafter: Drafter, out_dir: str | Path) -> None:
    write_drafter(drafter_tensors(drafter), drafter.config, out_dir)


def check_drafter_dir(drafter_dir: str | Path, name: str | None = None) -> tuple[dict, str]:
    """A drafter is a directory whose config.json names an EAGLE architecture: its config and
    that architecture, or a CheckpointError naming it (`name`: as the user gave it, e.g. by its
    flag or field)."""
    if not Path(drafter_dir).is_dir():
        raise CheckpointError(f"{name or drafter_dir}: " + ("a file; a drafter is a directory"
                                                            if Path(drafter_dir).exists() else "drafter directory not found"))
    path = Path(drafter_dir) / "config.json"
    if name and not path.is_file():
        raise CheckpointError(f"{name}: no config.json, so not a drafter directory")
    try:
        raw = read_json(path, "config.json")
    except CheckpointError as e:  # malformed
        if not name:
            raise
        raise CheckpointError(f"{name}: {e}") from None
    arch = (raw.get("architectures") or [None])[0] if isinstance(raw, dict) else None
    if arch not in EAGLE_ARCHITECTURES.values():
        model = "; it is a model (a drafter goes with its target model)" if (path.parent / "tokenizer.json").is_file() \
            else ""
        raise CheckpointError(f"{_config_of(path, name)}: architecture {arch!r} is not an EAGLE drafter; expected one "
                              f"of {sorted(set(EAGLE_ARCHITECTURES.values()))}{model}")
    return raw, arch


def _config_of(path: Path, name: str | None) -> str:
    """How an error names a drafter's config.json: by the flag or field it was given with, if any."""
    return f"{name}: config.json" if name else str(path)


def check_drafter_fits(drafter_dir: str | Path, target_cfg: ModelConfig, name: str | None = None) -> None:
    """The drafter in `drafter_dir` is one layer that fits a target of `target_cfg` (`name`: as
    `check_drafter_dir`)."""
    raw, arch = check_drafter_dir(drafter_dir, name)
    where = _config_of(Path(drafter_dir) / "config.json", name)
    cfg = ModelConfig.from_hf({**raw, "architectures": [arch.removesuffix("Eagle")]}, source=where)
    if cfg.num_hidden_layers != 1:
        raise CheckpointError(f"{where}: an EAGLE drafter has num_hidden_layers 1, got {cfg.num_hidden_layers}")
    check_fits(cfg, target_cfg, name or f"drafter {drafter_dir}")


def load_drafter(drafter_dir: str | Path, target: Transformer) -> Drafter:
    drafter_dir = Path(drafter_dir)
    check_drafter_fits(drafter_dir, target.config)
    # Checkpoints from other tools may carry a copy of the embedding or head: the target's wins.
    tensors = {k: v for k, v in read_safetensors(drafter_dir).items() if not k.startswith(SHARED_PREFIXES)}
    drafter = Drafter(target, fc_bias="fc.bias" in tensors)
    check_state_dict(split_fused(drafter.state_dict(), drafter.config), tensors, str(drafter_dir / "model.safetensors"))
    check_finite(tensors, str(drafter_dir / "model.safetensors"))
    drafter.load_state_dict(join_fused(tensors, drafter.config), strict=False)
    return drafter.to(device=target.device, dtype=target.dtype).eval()


def weights_checksum(module: nn.Module) -> str:
    """SHA-256 over parameter names and bytes: what an engine runs can be checked against
    what a trainer produced (stale or corrupted weights are detected, not silent)."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
