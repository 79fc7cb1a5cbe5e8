"""Llama/Qwen2-family decoder with three entry points.

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

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from tailtamer.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in at least float32 (as transformers does) so bfloat16 stays accurate.
        compute = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(compute)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


@lru_cache(maxsize=32)
def inv_freq(rope_theta: float, head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Rotary frequencies, in float64 for float64 models and float32 otherwise (as transformers)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    return (1.0 / rope_theta ** exponents).to(torch.float64 if dtype == torch.float64 else torch.float32)


def rotary_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin of shape (B, 1, T, head_dim) for absolute `positions` (B, T) (RoFormer, Su et al. 2021)."""
    freqs = positions.to(inv_freq.dtype)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd = cfg.head_size
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, cos, sin, mask=None, kv=None):
        """`mask`: bool (B, 1, T, S) or None for causal; `kv`: (k_cache, v_cache, CacheView) or None."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv is not None:
            k_cache, v_cache, view = kv
            k, v = view.update(k_cache, k), view.update(v_cache, v)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask=None, kv=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class CacheView:
    """Where one decode call writes and reads: cache rows `slots` (a tensor of slot ids, or a
    slice when the batch occupies consecutive slots, which needs no gather), new tokens at
    cache index `index` (B, q), keys and values read up to `span`."""

    def __init__(self, slots: torch.Tensor | slice, index: torch.Tensor, span: int):
        self.slots, self.index, self.span = slots, index, span
        rows = torch.arange(index.shape[0], device=index.device) if isinstance(slots, slice) else slots
        self.rows = rows[:, None]

    def update(self, cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Write new (B, kv_heads, q, dim) into the cache and return this batch's (B, kv_heads, span, dim)."""
        target = cache[self.slots] if isinstance(self.slots, slice) else cache
        # Cache rows are (slot, kv_head, position, dim); advanced indices put (B, q) first.
        target[self.rows, :, self.index] = new.transpose(1, 2)
        if isinstance(self.slots, slice):
            return target[:, :, : self.span]
        return cache[:, :, : self.span].index_select(0, self.slots)


class KVCache:
    """Static KV cache, one (slots, kv_heads, max_len, head_dim) tensor pair per layer.

    Rows are addressed by absolute cache index, so rejecting speculative tokens costs nothing:
    the next write to those indices overwrites them.
    """

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, device=None, dtype=torch.float32):
        shape = (cfg.num_hidden_layers, slots, cfg.num_key_value_heads, max_len, cfg.head_size)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.slots, self.max_len = slots, max_len

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` rows of a slot: to share a prefilled prompt between sibling
        samples, or to move a request into a lower slot and keep the batch contiguous."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def move_rows(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Move cache rows within a slot (all sources are read before any write): how an
        accepted draft path is committed to consecutive positions."""
        s, d = torch.tensor(src, device=self.k.device), torch.tensor(dst, device=self.k.device)
        self.k[:, slot, :, d] = self.k[:, slot, :, s]
        self.v[:, slot, :, d] = self.v[:, slot, :, s]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def decode_inputs(input_ids, cache: KVCache, slots, starts, positions=None, tree_mask=None):
    """Rotary positions, the (B, 1, q, span) attention mask and the CacheView of a decode call."""
    B, q = input_ids.shape
    offsets = torch.arange(q, device=input_ids.device)
    index = starts[:, None] + offsets
    if positions is None:
        positions = index
    span = int(starts.max()) + q
    if span > cache.max_len:
        raise ValueError(f"sequence of {span} tokens exceeds the KV cache length {cache.max_len}")
    if tree_mask is None:
        tree_mask = (offsets[:, None] >= offsets[None, :]).expand(B, q, q)
    window = tree_mask.shape[-1]
    key = torch.arange(span, device=input_ids.device)
    rel = key[None, None, :] - (starts + q - window)[:, None, None]  # key index within the window
    inside = (rel >= 0) & (rel < window)
    visible = torch.gather(tree_mask, 2, rel.clamp(0, window - 1).expand(B, q, span))
    mask = (rel < 0) | (inside & visible)
    return positions, mask[:, None], CacheView(slots, index, span)


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

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def _run(self, ids, positions, mask=None, cache=None, view=None):
        x = self.embed_tokens(ids)
        cfg = self.config
        cos, sin = rotary_tables(inv_freq(cfg.rope_theta, cfg.head_size, x.device, x.dtype), positions, x.dtype)
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.k[i], cache.v[i], view)
            x = layer(x, cos, sin, mask, kv)
        hidden = self.norm(x)
        return self.lm_head(hidden), hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None):
        """Training pass. `attn_mask` (B, T, T) bool overrides causal (e.g. packed samples)."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        mask = None if attn_mask is None else attn_mask[:, None]
        return self._run(input_ids, positions, mask)

    def decode(self, input_ids: torch.Tensor, cache: KVCache, slots: torch.Tensor | slice, starts: torch.Tensor,
               positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None):
        """Run q = input_ids.shape[1] new tokens per sequence against the cache.

        input_ids (B, q); slots (B,) cache slot per sequence, or slice(a, a + B) for consecutive
        slots (no gather); starts (B,) number of cache rows
        already valid; positions (B, q) rotary positions (default starts + arange(q));
        tree_mask (B, q, W) bool over the last W >= q cache rows ending with the new tokens: row i
        says which of them token i may attend to (default causal over the new tokens; W > q lets
        a draft tree attend to the nodes of earlier draft steps selectively). Rows before the
        window are always visible.
        Returns logits (B, q, V) and hidden states (B, q, H).
        """
        positions, mask, view = decode_inputs(input_ids, cache, slots, starts, positions, tree_mask)
        return self._run(input_ids, positions, mask, cache, view)

    def prefill(self, input_ids: torch.Tensor, cache: KVCache, slots: torch.Tensor | slice):
        """Prompts right-padded to a common length; pads sit after each prompt, so causal
        attention never lets a real token see one, and decode later overwrites their rows."""
        starts = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        return self.decode(input_ids, cache, slots, starts)
