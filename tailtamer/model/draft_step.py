"""The EAGLE drafter's inference step: its module path's function at half the cost per draft level.

An SD step runs the one-layer drafter once per draft level. On a small model every tensor
operation costs a few microseconds whatever its size, and the module path (`Drafter.forward`:
the decoder layer a target layer also runs) is ~45 of them at batch 1, so a depth-4 chain cost
as much as four target layers plus their setup: ~0.9 ms against a 2.2-ms plain step of the
built-in 16-layer base model (`bench profile`). `DraftStep` computes the same function in ~30,
most of them cheaper (views, in-place), from weights laid out for it once per drafter version
(a level ~150 -> ~80 µs at batch 1, the chain ~0.9 -> ~0.5 ms in the engine):

  - rotary folded into the q/k projection. RoFormer's rotation is x·cos + rotate_half(x)·sin,
    and rotate_half(Wx + b) = (PW)x + Pb for the permutation P that swaps each head's halves
    (the sign lives in `sin`, as in `apply_rotary`). One product gives rotate_half(q, k) and
    q, k, v side by side, and the rotation is two in-place operations instead of six.
  - weights transposed to (in, out) and residual adds fused into the products (`addmm`, in
    place): a product with a few rows and a transposed operand is ~1.5-2x slower on the CPU.
  - fc's two halves applied apart, fc([e; h]) = W_e e + W_h h + b: no concatenation.
  - the post-attention norm as x / √(Σx² + H·eps), its weight and √H folded into the gate/up
    projection: W(w ⊙ x̂) = (W·diag(w)) x̂ (a sum is cheaper than a mean on a CPU).

The result equals the module path up to float rounding (tests compare them). The training
pass keeps the module path (autograd, sharding); the target's own layers keep it too: their
products have many rows in prefill and training, where folded rows cost real arithmetic.
The derived weights are rebuilt, in place when they keep their shape (so a compiled chain
keeps reading them), when a drafter parameter changes storage or through a tracked in-place
write (its version counter), and whenever `refresh(rebuild=True)` is called: the engine does
so at every `generate` (`EagleProposer.reserve`), because a fused optimizer step
(`rl.optim.adamw`, which the spot trainer uses) and writes through `.data` bump no version
counter, and parameters replaced by new ones (`load_state_dict(assign=True)`) are seen only
when the parameters are listed again.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tailtamer.model.transformer import CacheRows, CacheView, causal_inputs, rotary, rotary_tables


class DraftStep:
    def __init__(self, drafter):
        cfg = drafter.config
        # eagle_config gives every drafter a layer without q/k norms (those sit between the
        # projection and the rotation, so the rotation could not be folded)
        assert not cfg.qk_norm, cfg.architecture
        self.drafter, self.config = drafter, cfg
        self.params = list(drafter.parameters())
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size
        self.qk = (self.nh + self.nkv) * self.hd  # the rotated rows: q and k
        self.gqa = self.nh != self.nkv  # computed here: under torch.compile(dynamic=True) the ints are symbolic
        self.key = None  # the parameters' storage and versions the derived weights are of

    def _key(self) -> tuple:
        # an inference tensor has no version counter (a drafter built under inference_mode)
        return tuple((p.data_ptr(), 0 if p.is_inference() else p._version) for p in self.params)

    def refresh(self, rebuild: bool = False) -> "DraftStep":
        # the parameters are listed again only when rebuilding (listing them is ~14 µs, a tenth
        # of a draft level; checking their storage and versions ~1.5)
        if rebuild:
            self.params = list(self.drafter.parameters())
        key = self._key()
        if rebuild or key != self.key:
            with torch.inference_mode(False), torch.no_grad():  # plain tensors: refreshable in place anywhere
                new = self._derive()
                if self.key is not None and all(_same_layout(getattr(self, name), t) for name, t in new.items()):
                    for name, t in new.items():
                        if t is not None:
                            getattr(self, name).copy_(t)
                else:
                    self.__dict__.update(new)
            self.key = key
        return self

    def _derive(self) -> dict[str, torch.Tensor | None]:
        d = self.drafter
        layer = d.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        nqk, hd = self.nh + self.nkv, self.hd

        def swapped_halves(t: torch.Tensor) -> torch.Tensor:  # P·t over the q and k rows
            heads = t[: self.qk].reshape(nqk, hd, *t.shape[1:])
            return torch.cat((heads[:, hd // 2:], heads[:, : hd // 2]), 1).reshape(self.qk, *t.shape[1:])

        def clone(t):
            return None if t is None else t.detach().clone()

        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        fc_t = d.fc.weight.t()
        H = fc_t.shape[1]
        # the norm's weight and √H (which `_rms_scaled` leaves out) folded in, in at least
        # float32: in bfloat16 the two products would round twice
        wide = torch.promote_types(w.dtype, torch.float32)
        gate_up = mlp.gate_up_proj.weight.to(wide) * (layer.post_attention_layernorm.weight.to(wide) * H ** 0.5)
        return {
            # fc's halves apart: for the token's embedding and for the feature (no concatenation)
            "fc_et": fc_t[:H].contiguous(), "fc_ht": fc_t[H:].contiguous(), "fc_b": clone(d.fc.bias),
            # columns: rotate_half(q, k), then q, k, v
            "qkv_t": torch.cat((swapped_halves(w), w)).t().contiguous(),
            "qkv_b": None if b is None else torch.cat((swapped_halves(b), b)),
            "o_t": attn.o_proj.weight.t().contiguous(), "o_b": clone(attn.o_proj.bias),
            "gu_t": gate_up.to(w.dtype).t().contiguous(),
            "gu_b": clone(mlp.gate_up_proj.bias),
            "down_t": mlp.down_proj.weight.t().contiguous(), "down_b": clone(mlp.down_proj.bias),
        }

    def forward(self, ids, hidden, cos, sin, mask, layer_cache, view) -> torch.Tensor:
        """`Drafter.forward`'s features for pairs (hidden, ids) (B, T): `cos`, `sin` their
        rotations (broadcasting to (B, T, heads, hd)), `mask` additive (broadcasting to
        (B, heads, T, span)) or None, `view` where `layer_cache` takes the new keys and values
        and gives the keys to read (`CacheView` or `CacheRows`). Returns the features (B, T, H).
        Slices are `narrow`s and `split`s: each indexing `[:, a:b]` is a tensor operation per
        axis."""
        B, T = ids.shape
        nqk, nh, nkv, hd = self.nh + self.nkv, self.nh, self.nkv, self.hd
        w = self.fc_ht
        H = w.shape[1]
        e = F.embedding(ids, self.drafter.target.embed_tokens.weight).view(B * T, H)
        x = torch.mm(e, self.fc_et) if self.fc_b is None else torch.addmm(self.fc_b, e, self.fc_et)
        x.addmm_(hidden.to(w.dtype).reshape(B * T, H), w)
        y = (torch.mm(x, self.qkv_t) if self.qkv_b is None else torch.addmm(self.qkv_b, x, self.qkv_t)).view(B, T, -1, hd)
        half, qk = y.narrow(2, 0, nqk), y.narrow(2, nqk, nqk)  # rotate_half(q, k); q, k
        qk.mul_(cos).addcmul_(half, sin)
        # into the cache tensor itself: compiled, a write through a reshaped view of it copies it back whole
        view.write(layer_cache, y.narrow(2, nqk + nh, 2 * nkv))
        k, v = view.read(layer_cache).split(nkv, 1)
        out = F.scaled_dot_product_attention(qk.narrow(2, 0, nh).transpose(1, 2), k, v, attn_mask=mask,
                                             enable_gqa=self.gqa)
        if self.o_b is not None:
            x.add_(self.o_b)
        x.addmm_(out.transpose(1, 2).reshape(B * T, nh * hd), self.o_t)
        n = _rms_scaled(x, self.config.rms_norm_eps)
        gate, up = (torch.mm(n, self.gu_t) if self.gu_b is None else torch.addmm(self.gu_b, n, self.gu_t)).chunk(2, -1)
        if self.down_b is not None:
            x.add_(self.down_b)
        x.addmm_(F.silu(gate).mul_(up), self.down_t)
        return x.view(B, T, H)

    def draft_chain(self, layer_cache: torch.Tensor, cache, slots, ids: torch.Tensor, hidden: torch.Tensor,
                    index: torch.Tensor | None, last: torch.Tensor | None, depth: int, span: int, tables=None,
                    mark=None, first: int | None = None, floor: float = 0.0, coupled: tuple | None = None
                    ) -> torch.Tensor:
        """A whole draft chain (B, depth; fewer with a `floor`): at each level the top-1 token,
        or with `coupled` = (g, draw, params) the token `draw(logits, params, g[:, d])` for level
        d + 1 (`rollout.sampling.coupled_drafts`, passed in: this layer knows nothing of how
        the rollout samples; g (B, depth, V), the target's noise). The extend
        over pairs (hidden, ids) (B, W) of `slots` (pairs past `last` are padding; None: every
        row's last pair is its last column), then depth - 1 levels from each row's last pair,
        level d + 1 running the pair (ĥ, d-th draft): a plain decode step of the drafter, no
        tree mask, no beam bookkeeping. `index` (B, W + depth - 1) holds the drafter rows
        (= positions) of the extend's pairs, from the row's first, then of each level,
        `chain_index`. The extend's and the levels' masks, rotations and cache rows are built
        at once, as for one call of W + depth - 1 tokens, and split into each call's (eager,
        building them per level was ~30 µs of a ~180 µs level at batch 1). Padding rows lie
        where the levels write next or past them, and causal attention never reads them.
        `span` covers every row the chain writes.

        `first` instead of `index` when every row's backlog is the same W pairs from row
        `first` (a batch of one always: the end of every long tail, where SD runs longest):
        then the chain's rows are first, first + 1, ... in every row, written and read by
        slicing (`CacheRows`), the rotations are a slice of the table, and no call needs a
        mask (~15 fewer tensor operations).

        Written for `torch.compile` too (`CompiledChain`: no Python between levels, slots
        0..B-1, `index`). `layer_cache` is `cache.kv[0]` passed in as its own tensor: taken
        inside the graph, it is a view of the cache's one tensor for all layers, and a
        compiled write through it copies that whole tensor back, which costs more than the
        chain. `mark(d)`, when given, is called after the extend (d = 0) and after level
        d + 1 (the eager chain's phase marks).

        `floor` > 0 (eager only: a Python decision per level): the chain stops after the first
        level at which every row's path probability (the product of the drafter's top-1
        probabilities so far) is below `floor`, and is shorter than `depth` (`Strategy`'s
        `@C`; coupled, still the top-1 tokens' probabilities: a confidence in the drafter's
        distribution, not in the coupled draft)."""
        B, W = ids.shape
        sizes = [W] + [1] * (depth - 1)
        calls = self._calls(index, cache, slots, span, sizes, layer_cache.dtype, tables) if first is None else \
            self._consecutive_calls(first, slots, sizes, layer_cache.dtype, ids.device, tables)
        head = self.drafter.target.lm_head.weight
        c, s, m, view = calls[0]
        x = self.forward(ids, hidden, c, s, m, layer_cache, view)
        x = x.narrow(1, W - 1, 1) if last is None else x[torch.arange(B, device=ids.device), last][:, None]
        logits = F.linear(x, head)
        tokens = [_pick(logits, coupled, 0)]  # (B, 1): the next level's ids
        path = logits.float().log_softmax(-1).amax(-1) if floor else None  # (B, 1) log path probability
        if mark is not None:
            mark(0)
        for d, (c, s, m, view) in enumerate(calls[1:], 1):
            if path is not None and bool((path < math.log(floor)).all()):
                break
            x = self.forward(tokens[-1], x, c, s, m, layer_cache, view)
            logits = F.linear(x, head)
            tokens.append(_pick(logits, coupled, d))
            if path is not None and d < depth - 1:  # the last level's is read by no decision
                path = path + logits.float().log_softmax(-1).amax(-1)
            if mark is not None:
                mark(d)
        return torch.cat(tokens, 1)

    def _calls(self, index, cache, slots, span: int, sizes: list[int], dtype, tables) -> list[tuple]:
        """Each call's (cos, sin, mask, CacheView) of a chain at drafter rows `index`."""
        positions, mask, view = causal_inputs(index, cache, slots, span)
        cos, sin = rotary(self.config, positions, dtype, tables)
        slot, heads, rows = view.at
        return [(c, s, m, CacheView(slots, span, (slot, heads, r)))
                for c, s, m, r in zip(cos.split(sizes, 1), sin.split(sizes, 1), mask.split(sizes, 2),
                                      rows.split(sizes, 1))]

    def _consecutive_calls(self, first: int, slots, sizes: list[int], dtype, device, tables) -> list[tuple]:
        """Each call's (cos, sin, mask, CacheRows) of a chain at rows first, first + 1, ... of
        every sequence. No call needs a mask: each reads the keys up to its own last row, and
        of the extend's rows only the last one's features are used (the others' attention,
        not causal here, is thrown away with them)."""
        cos, sin = tables if tables is not None else rotary_tables(self.config, device, dtype)
        n, W = sum(sizes), sizes[0]
        cos, sin = cos[first: first + n, None], sin[first: first + n, None]  # (n, 1, hd): alike in every row
        starts = [first] + [first + W + d for d in range(len(sizes) - 1)]
        return [(c, s, None, CacheRows(slots, a, q))
                for c, s, a, q in zip(cos.split(sizes), sin.split(sizes), starts, sizes)]


def _pick(logits: torch.Tensor, coupled: tuple | None, level: int) -> torch.Tensor:
    """A chain level's drafts (B, 1): the top-1 tokens, or the coupled ones (`draft_chain`)."""
    if coupled is None:
        return logits.argmax(-1)
    g, draw, params = coupled
    return draw(logits, params, g.narrow(1, level, 1))


def _rms_scaled(x: torch.Tensor, eps: float) -> torch.Tensor:
    """√H · `rms_normalize`(x) = x / √(Σx² + H·eps) over the last axis (H), in at least float32:
    a sum where `rms_normalize` takes a mean (5.1 against 6.6 µs at batch 1 on a CPU); √H is
    folded into the weights that follow."""
    if x.dtype in (torch.float32, torch.float64):
        return x * (x * x).sum(-1, keepdim=True).add_(x.shape[-1] * eps).rsqrt_()
    xf = x.float()
    return (xf * (xf * xf).sum(-1, keepdim=True).add_(x.shape[-1] * eps).rsqrt_()).to(x.dtype)


def _same_layout(old: torch.Tensor | None, new: torch.Tensor | None) -> bool:
    """Whether `new` can be copied into `old` in place (both absent counts)."""
    if old is None or new is None:
        return old is None and new is None
    return (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device)


def chain_index(firsts: list[int], ends: list[int], width: int, depth: int, device) -> torch.Tensor:
    """`DraftStep.draft_chain`'s drafter rows (B, width + depth - 1) for backlogs [first, end)
    right-padded to `width`: first + j for the extend's pairs, then end + d - 1 for level d + 1.
    Built here from the host's numbers: one tensor instead of ~8 operations on the device,
    which right after the verify forward cost ~4 µs each at batch 1 (cold caches)."""
    return torch.tensor([[f + j for j in range(width)] + [e + d for d in range(depth - 1)]
                         for f, e in zip(firsts, ends)], device=device)
