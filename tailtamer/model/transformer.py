"""Llama/Qwen2/Qwen3-family decoder with three entry points.

- `forward(ids)`: full-sequence causal pass for training; returns logits and final hidden states.
- `prefill(ids, cache, slots)`: `decode` from position 0 over right-padded prompts.
- `decode(ids, cache, slots, starts, positions, tree_mask)`: q new tokens per sequence,
  written into a static KV cache at cache index `starts[b] + i`, attending to everything the
  cache holds below `starts[b]` and to the new tokens allowed by `tree_mask` (causal by
  default). Rotary positions are given separately, so a draft tree whose nodes share a depth
  can share a position while occupying distinct cache rows (SpecInfer / EAGLE-2 tree verify).

Module and parameter names mirror Hugging Face's, so `model.io` maps checkpoints by prefix.
The "hidden states" returned are the final, post-norm ones: what EAGLE drafters consume.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

from tailtamer.model.config import Llama3RopeScaling, ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_normalize(x, self.eps) * self.weight


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) over the last axis (RMSNorm without its weight; Zhang & Sennrich
    2019), computed in at least float32 as transformers does, so bfloat16 stays accurate.
    Written out: F.rms_norm's CPU kernel casts back and forth and costs ~3x as much here; x * x
    and in-place steps where x.pow(2) and new tensors were: the same values, 6.6 against 8.1 µs
    at batch 1 on a CPU."""
    if x.dtype in (torch.float32, torch.float64):
        return x * (x * x).mean(-1, keepdim=True).add_(eps).rsqrt_()
    xf = x.float()
    return (xf * (xf * xf).mean(-1, keepdim=True).add_(eps).rsqrt_()).to(x.dtype)


def llama3_scaled(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency-dependent RoPE scaling, which stretches Llama 3's 8K context to
    128K ("The Llama 3 Herd of Models", Meta 2024; the formula is `apply_scaling` in Meta's
    reference code, github.com/meta-llama/llama-models, and transformers' rope_type 'llama3').

    With L = original_max_position_embeddings and a frequency f's wavelength λ = 2π / f:
      λ < L / high_freq_factor   (over high_freq_factor turns within L):  f, unchanged
      λ > L / low_freq_factor    (under low_freq_factor turns within L):  f / factor
      otherwise                  (blended):  (1 − s)·f / factor + s·f,
                                  s = (L / λ − low_freq_factor) / (high_freq_factor − low_freq_factor)
    s runs from 0 to 1 across the blended band, so clamping it to [0, 1] gives all three cases."""
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    turns = scaling.original_max_position_embeddings * inv_freq / (2 * math.pi)  # L / λ
    blend = ((turns - low) / (high - low)).clamp(0, 1)
    return (1 - blend) * inv_freq / scaling.factor + blend * inv_freq


@lru_cache(maxsize=32)
def rotary_table(rope_theta: float, head_dim: int, length: int, device: torch.device, dtype: torch.dtype,
                 scaling: Llama3RopeScaling | None = None):
    """cos and sign-folded sin for positions 0..length-1, each (length, head_dim), computed in
    float64 and rounded once (transformers computes the angles in float32 for float32
    models; the difference is below float32 rounding of the result)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    inv_freq = 1.0 / rope_theta ** exponents
    if scaling is not None:
        inv_freq = llama3_scaled(inv_freq, scaling)
    if dtype != torch.float64:  # the angles as transformers rounds them
        inv_freq = inv_freq.float()
    angles = torch.arange(length, device=device, dtype=inv_freq.dtype)[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoFormer (Su et al. 2021) rotation in transformers' rotate-half layout:
    x·cos + rotate_half(x)·sin with rotate_half(x) = (−x2, x1); the sign lives in `sin`."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), -1) * sin


class Attention(nn.Module):
    """q, k and v come from one fused projection (checkpoints keep transformers' three).
    Qwen3 normalises each q and k head (`q_norm`, `k_norm`, over head_dim) before the rotation."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd = cfg.head_size
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, mask=None, kv=None):
        """`mask`: additive (B, 1, T, S) or None for causal; `kv`: (one layer's cache, CacheView) or None."""
        B, T, _ = x.shape
        nh, nkv = self.n_heads, self.n_kv
        qkv = F.linear(x, self.qkv_proj.weight, self.qkv_proj.bias).view(B, T, nh + 2 * nkv, self.head_dim)
        qk = qkv[:, :, : nh + nkv]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm.forward(qk[:, :, :nh]), self.k_norm.forward(qk[:, :, nh:])), 2)
        qk = apply_rotary(qk, cos, sin)  # q and k heads rotate together
        q = qk[:, :, :nh].transpose(1, 2)
        if kv is None:
            k, v = qk[:, :, nh:].transpose(1, 2), qkv[:, :, nh + nkv:].transpose(1, 2)
        else:
            cache, view = kv
            keys = view.update(cache, torch.cat((qk[:, :, nh:], qkv[:, :, nh + nkv:]), 2))
            k, v = keys[:, :nkv], keys[:, nkv:]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads
        )
        return F.linear(out.transpose(1, 2).reshape(B, T, -1), self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    """SwiGLU; gate and up come from one fused projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = F.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias).chunk(2, -1)
        return F.linear(F.silu(gate) * up, self.down_proj.weight, self.down_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask=None, kv=None):
        # Sub-modules are entered by .forward and projections by F.linear: nn.Module.__call__
        # costs microseconds per call, which on small models is a large share of a decode step.
        # (The layer itself is entered through __call__: sharding wrappers hook it.)
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, mask, kv)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


# Checkpoints name projections as transformers does; inside, q/k/v and gate/up are fused (one
# matmul instead of three and two: on small models each op's overhead rivals its arithmetic).
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _fused_sizes(cfg: ModelConfig, fused: str) -> list[int]:
    if fused == "self_attn.qkv_proj":
        return [cfg.num_attention_heads * cfg.head_size] + [cfg.num_key_value_heads * cfg.head_size] * 2
    return [cfg.intermediate_size] * 2


def split_fused(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict with transformers' projection names (fused tensors split)."""
    out = {}
    for name, t in state.items():
        for fused, parts in FUSED.items():
            if f".{fused}." in name:
                for part, piece in zip(parts, t.split(_fused_sizes(cfg, fused))):
                    out[name.replace(fused, part)] = piece
                break
        else:
            out[name] = t
    return out


def join_fused(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `split_fused` (tensors already checked to be complete)."""
    out = dict(tensors)
    for name in list(tensors):
        for fused, parts in FUSED.items():
            if f".{parts[0]}." in name:
                names = [name.replace(parts[0], part) for part in parts]
                out[name.replace(parts[0], fused)] = torch.cat([out.pop(n) for n in names])
    return out


class CacheView:
    """Where one decode call writes and reads: cache slots `slots` (a tensor of slot ids, or a
    slice when the batch occupies consecutive slots, which needs no gather), each new key or
    value at (slot, head, row) `at`, keys and values read up to `span`. `CacheView.of` builds
    one from the new tokens' cache index (B, q)."""

    def __init__(self, slots: torch.Tensor | slice, span: int, at: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        self.slots, self.span, self.at = slots, span, at

    @classmethod
    def of(cls, slots: torch.Tensor | slice, index: torch.Tensor, span: int, heads: int) -> "CacheView":
        first = slots.start or 0 if isinstance(slots, slice) else 0
        rows = torch.arange(first, first + index.shape[0], device=index.device) if isinstance(slots, slice) else slots
        # built once for every layer: (B, 1, 1) slots, (heads,) heads, (B, q, 1) rows
        return cls(slots, span, (rows[:, None, None], torch.arange(heads, device=index.device), index[:, :, None]))

    def update(self, cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Write new (B, q, 2·kv_heads, dim) keys and values into one layer's cache and return
        this batch's (B, 2·kv_heads, span, dim)."""
        self.write(cache, new)
        return self.read(cache)

    def write(self, cache: torch.Tensor, new: torch.Tensor) -> None:
        """New (B, q, 2·kv_heads, dim) keys and values into one layer's cache, in one indexed
        write (into the cache tensor itself: under torch.compile, a write through a reshaped
        view of it is copied back whole, which costs more than the step)."""
        cache.index_put_(self.at, new)

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        """This batch's (B, 2·kv_heads, span, dim) keys and values in one layer's cache."""
        if isinstance(self.slots, slice):
            return cache[self.slots, :, : self.span]
        return cache[:, :, : self.span].index_select(0, self.slots)


class CacheRows:
    """`CacheView` for a call whose new tokens sit at the same consecutive cache rows
    first..first + q - 1 in every sequence of the batch (a batch of one always): written and
    read by slicing, without index tensors, and keys read only up to the last new row, so a
    single new token sees every key read and needs no mask."""

    def __init__(self, slots: slice, first: int, q: int):
        # slots as a tensor would make the write an indexing copy, written and thrown away
        assert isinstance(slots, slice), slots
        self.slots, self.first, self.span = slots, first, first + q

    def write(self, cache: torch.Tensor, new: torch.Tensor) -> None:
        cache[self.slots, :, self.first: self.span].copy_(new.transpose(1, 2))

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        return cache[self.slots, :, : self.span]


class KVCache:
    """Static KV cache: per layer one (slots, 2·kv_heads, max_len, head_dim) tensor, keys then
    values along the head axis, so a decode step writes both with one indexed copy. Heads come
    before rows so that attention reads each head's keys as one contiguous block: with rows
    first, (slots, max_len, heads, dim), a plain decode step at 512 running cost 87 ms against
    59, attention being 79% of it.

    Rows are addressed by absolute cache index, so rejecting speculative tokens costs nothing:
    the next write to those indices overwrites them.
    """

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, device=None, dtype=torch.float32):
        shape = (cfg.num_hidden_layers, slots, 2 * cfg.num_key_value_heads, max_len, cfg.head_size)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        # as plain values: a compiled drafter chain that read them off `kv` would take the whole
        # tensor in as an input aliasing the one layer it writes, which Inductor cannot compile.
        # `heads` counts keys and values: 2·kv_heads.
        self.slots, self.heads, self.max_len, self.dtype = slots, shape[2], max_len, dtype

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` rows of a slot: to share a prefilled prompt between sibling
        samples, or to move a request into a lower slot and keep the batch contiguous."""
        self.kv[:, dst, :, :length] = self.kv[:, src, :, :length]

    def move_rows(self, moves: list[tuple[int, list[int], list[int]]]) -> None:
        """Move cache rows within slots, for (slot, source rows, destination rows) triples, in
        one indexed copy (all sources are read before any write): how accepted draft paths
        are committed to consecutive positions."""
        dev = self.kv.device
        slots = torch.tensor([s for s, src, _ in moves for _ in src], device=dev)
        src = torch.tensor([i for _, rows, _ in moves for i in rows], device=dev)
        dst = torch.tensor([i for _, _, rows in moves for i in rows], device=dev)
        self.kv[:, slots, :, dst] = self.kv[:, slots, :, src]

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def rotary_tables(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    """The model's cos and sin tables (`rotary_table`), one per device and dtype."""
    # headroom past the context: draft-tree nodes of a request at its limit (discarded anyway)
    return rotary_table(cfg.rope_theta, cfg.head_size, cfg.max_position_embeddings + 1024, device, dtype,
                        cfg.rope_scaling)


def rotary(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype, tables=None):
    """cos, sin of shape (B, T, 1, head_dim) for absolute `positions` (B, T). A compiled
    caller passes `tables` in: traced, the cached table function would be recomputed per call."""
    cos, sin = tables if tables is not None else rotary_tables(cfg, positions.device, dtype)
    return cos[positions][:, :, None], sin[positions][:, :, None]


def decode_inputs(input_ids, cache: KVCache, slots, starts, positions=None, tree_mask=None, span=None):
    """Rotary positions, the additive (B, 1, q, span) attention mask (built once, shared by
    every layer) and the CacheView of a decode call. `span` = max(starts) + q when the caller
    knows it (reading starts back costs a device sync)."""
    B, q = input_ids.shape
    index = starts[:, None] + torch.arange(q, device=input_ids.device)
    if span is None:
        span = int(starts.max()) + q
    if tree_mask is None:
        return causal_inputs(index, cache, slots, span, positions)
    window = tree_mask.shape[-1]
    key = torch.arange(span, device=index.device)
    rel = key[None, None, :] - (starts + q - window)[:, None, None]  # key index within the window
    inside = (rel >= 0) & (rel < window)
    visible = (rel < 0) | (inside & torch.gather(tree_mask, 2, rel.clamp(0, window - 1).expand(B, q, span)))
    return _masked_inputs(visible, index, cache, slots, span, positions)


def causal_inputs(index, cache: KVCache, slots, span: int, positions=None):
    """`decode_inputs` for new tokens at cache rows `index` (B, q), consecutive or not, each
    seeing every row up to its own: a draft chain's extend and levels in one set-up."""
    visible = torch.arange(span, device=index.device) <= index[..., None]
    return _masked_inputs(visible, index, cache, slots, span, positions)


def _masked_inputs(visible, index, cache: KVCache, slots, span: int, positions):
    if span > cache.max_len:
        raise ValueError(f"sequence of {span} tokens exceeds the KV cache length {cache.max_len}")
    mask = torch.where(visible, 0.0, float("-inf"))  # one operation, where zeros + ~ + masked_fill_ were three
    if mask.dtype != cache.dtype:
        mask = mask.to(cache.dtype)
    return index if positions is None else positions, mask[:, None], CacheView.of(slots, index, span, cache.heads)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # generation_config.json's fields, which `model.io` reads and writes back
        self.generation_config: dict = {}
        # rl.grad_checkpointing: training passes keep only each layer's input and recompute the
        # layer in backward (activation memory of one layer instead of all of them).
        self.grad_checkpointing = False

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def _hidden(self, ids, positions, mask=None, cache=None, view=None):
        x = self.embed_tokens(ids)
        cos, sin = rotary(self.config, positions, x.dtype)
        recompute = self.grad_checkpointing and cache is None and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if recompute:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, mask, None, use_reentrant=False)
                continue
            kv = None if cache is None else (cache.kv[i], view)
            x = layer(x, cos, sin, mask, kv)
        return self.norm(x)

    def _run(self, ids, positions, mask=None, cache=None, view=None, logits_at=None):
        hidden = self._hidden(ids, positions, mask, cache, view)
        if logits_at is not None:  # (B,) one position per row: the LM head only there
            return self.lm_head(hidden[torch.arange(len(logits_at), device=hidden.device), logits_at][:, None]), hidden
        return self.lm_head(hidden), hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None):
        """Training pass. `attn_mask` (B, T, T) bool overrides causal (e.g. packed samples)."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        mask = None if attn_mask is None else attn_mask[:, None]
        return self._run(input_ids, positions, mask)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final (normed) hidden states of a causal pass, (B, T, H), without the LM head:
        what the drafter learns from (the (B, T, V) logits of a 150k vocabulary would be 40x
        the hidden states' memory, computed to be thrown away)."""
        B, T = input_ids.shape
        return self._hidden(input_ids, torch.arange(T, device=input_ids.device).expand(B, T))

    def decode(self, input_ids: torch.Tensor, cache: KVCache, slots: torch.Tensor | slice, starts: torch.Tensor,
               positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None, span: int | None = None):
        """Run q = input_ids.shape[1] new tokens per sequence against the cache.

        input_ids (B, q); slots (B,) cache slot per sequence, or slice(a, a + B) for consecutive
        slots (no gather); starts (B,) number of cache rows
        already valid; positions (B, q) rotary positions (default starts + arange(q));
        tree_mask (B, q, W) bool over the last W >= q cache rows ending with the new tokens: row i
        says which of them token i may attend to (default causal over the new tokens; W > q lets
        a draft tree attend to the nodes of earlier draft steps selectively). Rows before the
        window are always visible.
        span (int): max(starts) + q, if the caller knows it.
        Returns logits (B, q, V) and hidden states (B, q, H).
        """
        positions, mask, view = decode_inputs(input_ids, cache, slots, starts, positions, tree_mask, span)
        return self._run(input_ids, positions, mask, cache, view)

    def prefill(self, input_ids: torch.Tensor, cache: KVCache, slots: torch.Tensor | slice,
                last: torch.Tensor | None = None):
        """Prompts right-padded to a common length; pads sit after each prompt, so causal
        attention never lets a real token see one, and decode later overwrites their rows.
        `last` (B,): logits only at each prompt's last position, (B, 1, V), as the engine
        needs (the full (B, T, V) of a long prompt batch with a large vocabulary is gigabytes)."""
        starts = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        positions, mask, view = decode_inputs(input_ids, cache, slots, starts, None, None, input_ids.shape[1])
        return self._run(input_ids, positions, mask, cache, view, logits_at=last)
