"""What a training worker will hold in memory, estimated before anything is loaded, and a
one-line refusal of a configuration that cannot fit (naming the setting to change).

All figures are bytes per worker. Notation: P parameters of the policy (`num_parameters()`,
tied embeddings counted once), n its parameter tensors, b the weights' bytes per element (the
trainer keeps float32 weights, the masters the rollout also runs: 4), c the precision of the
training forwards (run.dtype, under autocast: 2 for bfloat16, else b), L layers, H hidden
size, I intermediate size, V vocabulary, q = attention heads x head_dim, kv = key-value heads
x head_dim, N the workers FSDP shards the update's copy of the policy over (1: unsharded).

Exact pieces (tested against real tensors):
  policy        P·b / N             the weights the update trains (its shard under FSDP)
  master        P·4 / N             float32 masters of 16-bit weights (`master_fp32`; the trainer's
                                    float32 weights are their own masters: 0)
  grads         P·g / N             g = 4 with masters, else b. `zero_grad(set_to_none)` runs at the
                                    start of each minibatch, so the last one's gradients live on
                                    through the next rollout: counted as always live
  optimizer     2·P·g / N + 4·n     AdamW's two moments in the dtype of what it updates (PyTorch keeps
                                    a bfloat16 parameter's moments in bfloat16) and a 4-byte `step`
                                    per tensor
  rollout_copy  P·b when N > 1      FSDP shards only the update's copy: every worker keeps the whole
                                    policy for its engine, old log-probs and checkpoints
                + (P + D)·e'        on rollout.backend=vllm: vLLM's own copy of the policy and the
                                    drafter, in its dtype e' (vllm.dtype)
  reference     P·c                 the frozen reference model (rl.kl_coef > 0), loaded in run.dtype
  kv_cache      2·L·slots·len·kv·e  the engine's static cache (e: its bytes per element, the engine's
                                    model's dtype); kept between steps, so live during the update too;
                                    on rollout.backend=vllm, vllm.kv_cache_gb (vLLM allocates that,
                                    the drafter's layer included, and the drafter has no state of ours)
  drafter       the EAGLE drafter: its own weights D·b (D = fc 2H·H + H and one decoder layer without
                input norm; embedding and LM head are the policy's) + its rollout state (features
                slots·d·H·b, next tokens slots·d·8, a one-layer KV cache of 2·d rows per slot, d the
                proposer's reserved length) + when it trains: grads D·b, AdamW 2·D·b + 4 per tensor,
                the DataBuffer's cap (spot.buffer_mb, on the policy's device) and the frozen copy
                spot.compare_frozen scores against (D·b)

Rough pieces (documented models, meant to be conservative but not absurd):
  update_weights  weights the update holds besides the policy: autocast's c-byte copies of
                every matmul weight (LM head and projections), saved for the backward, when
                c < b; under FSDP the all-gathered root (embedding, LM head) and two layers
                (the one running and the one prefetched), in b
  activations   one update micro-batch of T tokens (T = max(rl.micro_batch_tokens, the widest
                sample): a row wider than the budget goes alone). Per layer per token, what
                autograd saves in this implementation (exactly, as counted by saved-tensor hooks,
                in float32, bfloat16 and float32 weights under bfloat16 autocast):
                  a = 2·(4 + b + c)·H      two RMSNorms (float32 statistics and normalised input,
                                           the projection's input)
                    + c·(3q + 3kv)         fused qkv output, rotated q/k, attention output
                    + 4c·I                 fused gate/up output, SiLU, product
                    + 4·heads + 8          attention log-sum-exp (float32), norm statistics
                    + (4 + c')·(q + kv)    Qwen3's q/k norms (c' = c when 16-bit, else 0)
                      + 4·(heads + kv_heads)
                    + c·heads·S            attention scores of width S, only when the attention
                                           kernel stores them: by default for float32 compute
                                           (CUDA's flash kernel is 16-bit only, and the fallback
                                           materialises them); flash kernels keep O(H) per token
                without checkpointing:  T·((L + 1)·a + f)       (+1 layer: backward transients)
                with checkpointing:     T·(L·b·H + 3a/2 + f)    (the layers' inputs, and one layer
                                        recomputed with its backward transients: ~1.25·a measured)
                with f = (4 + b + c)·H + 2·b·head_dim (final norm, rotary tables).
  logits        T·V·(c + 12): the logits in the compute dtype, the float32 log-softmax autograd
                keeps, its incoming gradient and the gradient it produces, all live at the start
                of the backward; + 12·T·V with the entropy bonus (a second log-softmax, its exp and
                their product). Checkpointing does not shrink it, and for big vocabularies it
                dominates: Qwen2.5's 152,064 tokens in bfloat16 take 2.1 MB a token, 8.1 GiB for
                4096 tokens, nearly 4x a checkpointed 7B model's layer activations: lower
                rl.micro_batch_tokens.
                update_weights + activations + logits, against the peak resident memory of one
                real micro-batch's forward and backward on CPU (tests/test_memory.py): 1.0-1.25x
                the measured figure without checkpointing, 1.35-1.6x with it.
  rollout_activations  the largest of the rollout's transients (the rollout runs the b-byte
                model): a prefill's one layer over every prompt token and logits at each
                prompt's last position, prefill_tokens·a + prefill_rows·b·V (the largest is
                often an evaluation's, ⌈data.n_eval / N⌉ prompts at once), a decode
                step's logits, float32 sampling probabilities and the float64 draw (its
                probabilities' logs and the Gumbel noise: decode_rows·(b + 36)·V, rows =
                requests x tokens verified), and a spot-training step of the drafter on M packed
                tokens (~M·(2a + (2b + 24)·V) + M², see `_drafter_training_bytes`). On
                rollout.backend=vllm, vLLM's step instead of the prefill and the decode: one
                layer over its token budget and logits where it samples,
                step_tokens·a' + decode_rows·12·V (a' in vLLM's dtype, VLLM_STEP_TOKENS).
  samples       R·len·SAMPLE_TOKEN_BYTES for the R requests of a step (prompts x group_size of the
                worker's shard, or an evaluation's), each up to len tokens: its token lists
                (Python ints) and the update's tensors of it (ids, masks, log-probs,
                advantages); and the sampling noise our engine keeps for them, R·NOISE_WINDOW·V
                float64 if that fits in NOISE_BUDGET, else none (rollout/sampling.py `TargetDraws`). Live
                through the rollout and the update.

total = persistent + max(rollout_activations, update_weights + activations + logits), where
persistent = policy + master + grads + optimizer + rollout_copy + reference + kv_cache +
drafter + samples: the update's transients and the rollout's never live together. Allocator
fragmentation, the CUDA context (~0.5 GiB) and PyTorch's workspaces are not counted;
`check_fits` keeps a 10% margin for them.

`estimate` returns the pieces above (PIECES), `total`, the candidates for
rollout_activations (`prefill`, `decode`, `vllm_step`, `drafter_training`) and, for messages, `slots`,
`cache_len`, `seq_len` (the widest sample: cache rows past it are a verify's), `tokens` (T),
`shard_world`, `grad_checkpointing` (0/1), `weight_bytes` and `compute_bytes`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from tailtamer.errors import ConfigError
from tailtamer.model.config import ModelConfig
from tailtamer.rollout.sampling import noise_table_bytes
from tailtamer.rollout.speculative import Strategy, rows_ahead

if TYPE_CHECKING:
    from tailtamer.config import TrainConfig

MARGIN = 0.10  # of the available memory, kept free (fragmentation, CUDA context, workspaces)
MEMINFO = "/proc/meminfo"
# In order of preference when two pieces tie for the largest (the refusal names the first).
PERSISTENT = ("policy", "master", "grads", "optimizer", "reference", "kv_cache", "drafter", "rollout_copy", "samples")
# a token of a request: a list slot and int object (36), the update's ids, mask and float32
# log-probs and advantage (8 + 1 + 12), rounded up
SAMPLE_TOKEN_BYTES = 64
PIECES = PERSISTENT + ("update_weights", "activations", "logits", "rollout_activations")
# vLLM's forward on rollout.backend=vllm: at most max_num_batched_tokens tokens, whose largest
# default is 16,384 (LLM class, GPUs of 70 GiB or more; the backend raises it to the batch size,
# and to the context on a CPU); logits only at the positions it samples, float32, with their
# probabilities and logs.
VLLM_STEP_TOKENS = 16_384
VLLM_ROW_BYTES = 12
DTYPE_BYTES = {"float64": 8, "float32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}


# --- exact counts ---------------------------------------------------------------------------------


def layer_parameters(cfg: ModelConfig) -> int:
    """Parameters of one decoder layer: (num_parameters − embeddings − final norm) / L."""
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return (cfg.num_parameters() - embeddings - cfg.hidden_size) // cfg.num_hidden_layers


def layer_tensors(cfg: ModelConfig) -> int:
    """Parameter tensors of one decoder layer (fused qkv and gate/up, as tailtamer builds them)."""
    return (1 + cfg.qkv_bias + 1 + cfg.o_bias + (2 if cfg.qk_norm else 0)  # attention
            + 2 * (1 + cfg.mlp_bias)  # gate_up, down
            + 2)  # input and post-attention norms


def param_tensors(cfg: ModelConfig) -> int:
    """n: the policy's parameter tensors (a tied LM head is the embedding's tensor)."""
    return 1 + (0 if cfg.tie_word_embeddings else 1) + 1 + cfg.num_hidden_layers * layer_tensors(cfg)


def drafter_config(cfg: ModelConfig) -> ModelConfig:
    from tailtamer.model.drafter import eagle_config

    return eagle_config(cfg)


def drafter_parameters(cfg: ModelConfig) -> int:
    """D: the EAGLE drafter's own parameters for target `cfg`: fc (2H → H, with bias) and one
    decoder layer of its architecture without the input norm."""
    h = cfg.hidden_size
    return 2 * h * h + h + layer_parameters(drafter_config(cfg)) - h


def drafter_tensors(cfg: ModelConfig) -> int:
    return 2 + layer_tensors(drafter_config(cfg)) - 1


def kv_cache_bytes(cfg: ModelConfig, slots: int, cache_len: int, cache_bytes: int, layers: int | None = None) -> int:
    """2·L·slots·cache_len·kv_heads·head_dim·bytes: `KVCache`'s (L, slots, 2·kv, len, dim) tensor."""
    layers = cfg.num_hidden_layers if layers is None else layers
    return 2 * layers * slots * cache_len * cfg.num_key_value_heads * cfg.head_size * cache_bytes


def adamw_bytes(params: int, tensors: int, state_bytes: int) -> int:
    """exp_avg and exp_avg_sq (`state_bytes` each per parameter) + a float32 `step` per tensor."""
    return 2 * params * state_bytes + 4 * tensors


# --- rough models ---------------------------------------------------------------------------------


def linear_parameters(cfg: ModelConfig) -> int:
    """Parameters autocast casts for matmuls: the LM head (V·H, tied or not) and every layer's
    projections (everything but the embedding table and the RMSNorm weights)."""
    norms = 2 * cfg.hidden_size + (2 * cfg.head_size if cfg.qk_norm else 0)
    return cfg.vocab_size * cfg.hidden_size + cfg.num_hidden_layers * (layer_parameters(cfg) - norms)


def layer_activation_bytes(cfg: ModelConfig, weight_bytes: int, compute_bytes: int | None = None, width: int = 0,
                           attention_scores: bool = False) -> int:
    """a: bytes autograd keeps per token for one decoder layer (see the module docstring)."""
    b = weight_bytes
    c = b if compute_bytes is None else compute_bytes
    h = cfg.hidden_size
    q = cfg.num_attention_heads * cfg.head_size
    kv = cfg.num_key_value_heads * cfg.head_size
    a = (2 * (4 + b + c) * h + c * (3 * q + 3 * kv) + 4 * c * cfg.intermediate_size
         + 4 * cfg.num_attention_heads + 8)
    if cfg.qk_norm:  # float32: the normalised heads; 16-bit: their float32 copy and the normalised heads
        a += (4 + (c if c < 4 else 0)) * (q + kv) + 4 * (cfg.num_attention_heads + cfg.num_key_value_heads)
    if attention_scores:
        a += c * cfg.num_attention_heads * width
    return a


def update_activation_bytes(cfg: ModelConfig, weight_bytes: int, tokens: int, width: int, grad_checkpointing: bool,
                            attention_scores: bool, compute_bytes: int | None = None) -> int:
    """One micro-batch's activations, without the logits (module docstring)."""
    b = weight_bytes
    c = b if compute_bytes is None else compute_bytes
    h = cfg.hidden_size
    a = layer_activation_bytes(cfg, b, c, width, attention_scores)
    rest = (4 + b + c) * h + 2 * b * cfg.head_size  # final norm, rotary tables
    if grad_checkpointing:
        return tokens * (cfg.num_hidden_layers * b * h + 3 * a // 2 + rest)
    return tokens * ((cfg.num_hidden_layers + 1) * a + rest)


def logits_bytes(vocab_size: int, tokens: int, compute_bytes: int, entropy: bool = False) -> int:
    """T·V·(c + 12) (+ 12·T·V with the entropy bonus): see the module docstring."""
    return tokens * vocab_size * (compute_bytes + 12 + (12 if entropy else 0))


def _drafter_training_bytes(cfg: ModelConfig, dtype_bytes: int, tokens: int, attention_scores: bool) -> int:
    """One spot-training step on M packed tokens: the drafter layer's activations (twice, for
    the backward), its input (2H), the hidden states in and out (float32 and cast), the
    logits of prediction and target with the float32 softmax / log-softmax of the loss and
    their gradients ((2b + 24)·V per token), and the packed (M, M) attention mask (and, when
    the kernel stores them, the scores: a mask rules out flash kernels)."""
    b, h, v = dtype_bytes, cfg.hidden_size, cfg.vocab_size
    a = layer_activation_bytes(drafter_config(cfg), b, b, tokens, attention_scores)
    per_token = 2 * a + 2 * b * h + 2 * (4 + b) * h + (2 * b + 24) * v
    return tokens * per_token + tokens * tokens * (1 + (b * cfg.num_attention_heads if attention_scores else 0))


# --- the estimate ---------------------------------------------------------------------------------


def _shard(n: int, world: int) -> int:
    return -(-n // world)


def estimate(model_cfg: ModelConfig, *, weight_bytes: int, master_fp32: bool, slots: int, cache_len: int,
             cache_bytes: int, micro_batch_tokens: int, reference: bool, drafter: bool, drafter_trains: bool,
             shard_world: int = 1, grad_checkpointing: bool = False, compute_bytes: int | None = None,
             seq_len: int | None = None, entropy: bool = False, attention_scores: bool | None = None,
             prefill_tokens: int = 0, prefill_rows: int = 0, decode_rows: int | None = None, drafter_cache_len: int | None = None,
             drafter_buffer_bytes: int = 0, drafter_tokens: int = 512, drafter_frozen: bool = False,
             requests: int = 0, vllm_cache: int = 0, vllm_weight_bytes: int = 0,
             vllm_step_tokens: int = 0) -> dict[str, int]:
    """Bytes per worker of each piece and the total (module docstring: formulas and what is
    exact). `compute_bytes`: the precision of the training forwards (autocast; default the
    weights'), also the reference model's. `seq_len` is the widest sample of the update
    (default `cache_len`): a micro-batch holds max(micro_batch_tokens, seq_len) tokens.
    `attention_scores` None: counted for float32 compute. `prefill_tokens` / `prefill_rows` /
    `decode_rows`: the largest prefill (prompts x their width, and its prompts) and decode step
    (rows x tokens verified; default `slots`) of the rollout. `drafter_cache_len`: the length the EAGLE proposer
    reserves (default `cache_len`). `requests`: the step's requests, each up to `cache_len` tokens.
    `vllm_cache` > 0: the rollout runs on vLLM, with this KV cache, its weights in
    `vllm_weight_bytes` and at most `vllm_step_tokens` tokens a forward."""
    if shard_world < 1:
        raise ValueError(f"shard_world must be >= 1, got {shard_world}")
    cfg, b, N = model_cfg, weight_bytes, shard_world
    c = b if compute_bytes is None else compute_bytes
    P, n = cfg.num_parameters(), param_tensors(cfg)
    master = master_fp32 and b < 4
    state_bytes = 4 if master else b
    seq_len = cache_len if seq_len is None else seq_len
    scores = c >= 4 if attention_scores is None else attention_scores
    tokens = max(micro_batch_tokens, seq_len)
    decode_rows = slots if decode_rows is None else decode_rows
    casts = linear_parameters(cfg) * c if c < b else 0
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size
    gathered = (embeddings + 2 * layer_parameters(cfg)) * b if N > 1 else 0  # FSDP: the root and two layers

    est = {
        "policy": _shard(P * b, N),
        "master": _shard(P * 4, N) if master else 0,
        "grads": _shard(P * state_bytes, N),
        "optimizer": _shard(2 * P * state_bytes, N) + 4 * n,
        "rollout_copy": (P * b if N > 1 else 0) + P * vllm_weight_bytes,
        "reference": P * c if reference else 0,
        "kv_cache": vllm_cache or kv_cache_bytes(cfg, slots, cache_len, cache_bytes),
        "drafter": 0,
        "samples": requests * cache_len * SAMPLE_TOKEN_BYTES + (0 if vllm_cache else
                                                                noise_table_bytes(requests, cfg.vocab_size)),
        "update_weights": casts + gathered,
        "activations": update_activation_bytes(cfg, b, tokens, seq_len, grad_checkpointing, scores, c),
        "logits": logits_bytes(cfg.vocab_size, tokens, c, entropy),
    }
    layer = layer_activation_bytes(cfg, b, b, seq_len, b >= 4 if attention_scores is None else attention_scores)
    phases = {"prefill": prefill_tokens * layer + prefill_rows * b * cfg.vocab_size,
              "decode": decode_rows * (b + 36) * cfg.vocab_size, "vllm_step": 0, "drafter_training": 0}
    if vllm_cache:  # vLLM prefills and decodes, in steps of at most its token budget
        e = vllm_weight_bytes
        phases.update(prefill=0, decode=0, vllm_step=vllm_step_tokens * layer_activation_bytes(cfg, e, e)
                      + decode_rows * VLLM_ROW_BYTES * cfg.vocab_size)
    if drafter:
        D, d = drafter_parameters(cfg), cache_len if drafter_cache_len is None else drafter_cache_len
        state = slots * d * (cfg.hidden_size * b + 8) + kv_cache_bytes(cfg, slots, 2 * d, cache_bytes, layers=1)
        est["drafter"] = D * b + (0 if vllm_cache else state)
        est["rollout_copy"] += D * vllm_weight_bytes
        if drafter_trains:
            est["drafter"] += D * b + adamw_bytes(D, drafter_tensors(cfg), b) + drafter_buffer_bytes \
                + (D * b if drafter_frozen else 0)
            phases["drafter_training"] = _drafter_training_bytes(cfg, b, max(drafter_tokens, seq_len), scores)
    est["rollout_activations"] = rollout = max(phases.values())
    engine_weights = est["rollout_copy"] - (P * b if N > 1 else 0)
    persistent = sum(est[k] for k in PERSISTENT)
    est["total"] = persistent + max(rollout, est["update_weights"] + est["activations"] + est["logits"])
    est.update(phases, slots=slots, cache_len=cache_len, seq_len=seq_len, tokens=tokens, shard_world=N,
               grad_checkpointing=int(grad_checkpointing), weight_bytes=b, compute_bytes=c, vllm=int(vllm_cache > 0),
               vllm_weights=engine_weights, vllm_weight_bytes=vllm_weight_bytes)
    return est


def _strategies(spec) -> list:
    return [Strategy.parse(s) for s in spec.in_use]


def estimate_for(cfg: "TrainConfig", model_cfg: ModelConfig, world: int = 1, dtype_bytes: int | None = None, *,
                 weight_bytes: int = 4, master_fp32: bool = False, device_type: str = "cuda") -> dict[str, int]:
    """`estimate` with the arguments the trainer's own setup implies for one of `world` workers:

    - the training forwards (and the reference model) in `dtype_bytes`: pass the resolved
      `tailtamer.device.train_dtype(...).itemsize`; None reads run.dtype (auto reads as
      float32, which it is on CPU); the weights, the engine's KV cache and the drafter in
      `weight_bytes` (the trainer loads the policy in float32);
    - attention scores: counted for float32 on CUDA (see the module docstring), never on
      `device_type` cpu (PyTorch's CPU flash kernel takes float32 and keeps none);
    - slots: the engine allocates min(rollout.max_batch_size, requests) cache slots, where a
      worker's requests are its contiguous shard of the prompts, ⌈prompts_per_step / world⌉,
      times group_size (or ⌈data.n_eval / world⌉ greedy requests in an evaluation);
    - cache_len: the longest request, prompt + response = min(context, prompt limit +
      rollout.max_new_tokens) with prompt limit = min(data.max_prompt_tokens, context − 1),
      plus the largest tree verified when spec.mode is on / adaptive; the EAGLE proposer
      reserves that + max(tokens verified, draft rows) + 1;
    - reference when rl.kl_coef > 0; an EAGLE drafter when spec.mode is not off and
      spec.drafter is not ngram; it trains when spot.train and there is time to train it
      (world > 1 or spot.single_worker=window), as `setup` decides;
    - shard_world = world when run.shard is fsdp; rl.grad_checkpointing; the entropy bonus
      when rl.entropy_coef > 0. (run.shard, run.dtype and rl.grad_checkpointing are read with
      getattr: a config without them reads as none, float32 and off.)
    """
    run, roll, rl, spec, spot = cfg.run, cfg.rollout, cfg.rl, cfg.spec, cfg.spot
    if dtype_bytes is None:
        dtype_bytes = DTYPE_BYTES.get(str(getattr(run, "dtype", None) or "float32").removeprefix("torch."), weight_bytes)
    context = model_cfg.max_position_embeddings
    prompt_limit = min(cfg.data.max_prompt_tokens, context - 1)
    seq = min(context, prompt_limit + roll.max_new_tokens)
    prompts = _shard(roll.prompts_per_step, world)
    slots = min(roll.max_batch_size, prompts * roll.group_size)
    eval_requests = _shard(cfg.data.n_eval, world) if run.eval_every > 0 else 0
    requests = max(prompts * roll.group_size, eval_requests)
    slots = max(slots, min(roll.max_batch_size, eval_requests))
    # siblings share their prompt's prefill: the first `slots` requests hold ⌈slots / group⌉ prompts
    prefill_rows = max(min(prompts, _shard(slots, roll.group_size)), min(eval_requests, slots))
    prefill = prefill_rows * prompt_limit
    speculates = spec.mode != "off"
    verify = draft_rows = 0
    decode_rows = slots
    if speculates:
        verify, draft_rows = rows_ahead(_strategies(spec))
        decode_rows = max(slots, spec.most_verified(slots, device_type))
    eagle = spec.eagle
    trains = spot.trains(eagle, world)
    vllm = {}
    if getattr(roll, "backend", "tailtamer") == "vllm":
        dtype = cfg.vllm.dtype if cfg.vllm.dtype != "auto" else "float32" if device_type == "cpu" else "bfloat16"
        vllm = {"vllm_cache": int(cfg.vllm.kv_cache_gb * (1 << 30)), "vllm_weight_bytes": DTYPE_BYTES[dtype],
                "vllm_step_tokens": max(VLLM_STEP_TOKENS, slots, seq if device_type == "cpu" else 0)}
    return estimate(
        model_cfg, weight_bytes=weight_bytes, master_fp32=master_fp32, compute_bytes=dtype_bytes, slots=slots,
        cache_len=seq + verify, cache_bytes=weight_bytes,
        micro_batch_tokens=min(rl.micro_batch_tokens, rl.micro_batch_size * seq),
        reference=rl.kl_coef > 0, drafter=eagle, drafter_trains=trains,
        shard_world=world if getattr(run, "shard", "none") == "fsdp" else 1,
        grad_checkpointing=bool(getattr(rl, "grad_checkpointing", False)), seq_len=seq,
        entropy=rl.entropy_coef > 0, prefill_tokens=prefill, prefill_rows=prefill_rows, decode_rows=decode_rows,
        drafter_cache_len=seq + max(verify, draft_rows) + 1,
        drafter_buffer_bytes=spot.buffer_mb << 20 if trains else 0, drafter_tokens=spot.tokens_per_step,
        drafter_frozen=trains and spot.compare_frozen, attention_scores=None if device_type == "cuda" else False,
        requests=requests, **vllm)


# --- reporting and the refusal --------------------------------------------------------------------


# A generated response's host memory, measured loosely: each token is a Python int in the
# engine's list and in the completion's (36 bytes each), its text and its JSON line; each
# request its objects.
RESPONSE_TOKEN_BYTES = 96
RESPONSE_BYTES = 1024


# A built-in problem as a worker keeps it: a dict of its prompt's token ids (a list of ~15 small
# ints) and its answer string; 364 bytes on average by tracemalloc, rounded up.
BUILTIN_ROW_BYTES = 512


def responses_bytes(requests: int, max_new_tokens: int) -> int:
    """Host memory `requests` responses of up to `max_new_tokens` tokens each may hold at the
    end of a `generate`, when all of them are kept to be written: requests × (RESPONSE_BYTES
    + max_new_tokens × RESPONSE_TOKEN_BYTES), the worst case (every response full length)."""
    return requests * (RESPONSE_BYTES + max_new_tokens * RESPONSE_TOKEN_BYTES)


def size(n: int) -> str:
    """1.2 GiB, 12.3 MiB, 120 KiB; '-' for nothing."""
    if n <= 0:
        return "-"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{math.ceil(n / 1024)} KiB"


def _kv(est: dict) -> str:
    if est["vllm"]:
        return f"{size(est['kv_cache'])} (vLLM's, vllm.kv_cache_gb)"
    return f"{size(est['kv_cache'])} ({est['slots']:,} slots x {est['cache_len']:,} tokens)"


def format_estimate(est: dict, available: int | None = None) -> str:
    """One console line, e.g. `memory per worker: policy 1.2 GiB, grads 1.2 GiB, optimizer
    2.5 GiB, reference -, KV cache 3.1 GiB (512 slots x 1,344 tokens), update 0.8 GiB
    activations + 1.1 GiB logits (4,096 tokens), rollout activations 0.3 GiB, drafter 0.1 GiB;
    total 10.0 GiB of 139.0 GiB`."""
    policy = size(est["policy"])
    if est["shard_world"] > 1:
        policy += (f" (1/{est['shard_world']} shard; + {size(est['rollout_copy'] - est['vllm_weights'])} whole copy "
                   f"for the engine)")
    parts = [f"policy {policy}"] + ([f"vLLM's weights {size(est['vllm_weights'])}"] if est["vllm"] else [])
    if est["master"]:
        parts.append(f"fp32 master {size(est['master'])}")
    update = (f"update {size(est['activations'])} activations + {size(est['logits'])} logits "
              f"({est['tokens']:,} tokens{', checkpointed' if est['grad_checkpointing'] else ''})")
    if est["update_weights"]:
        update += f" + {size(est['update_weights'])} weight copies"
    parts += [f"grads {size(est['grads'])}", f"optimizer {size(est['optimizer'])}",
              f"reference {size(est['reference'])}", f"KV cache {_kv(est)}", update,
              f"rollout activations {size(est['rollout_activations'])}", f"drafter {size(est['drafter'])}",
              f"samples {size(est['samples'])}"]
    of = f" of {size(available)}" if available is not None else ""
    return f"memory per worker: {', '.join(parts)}; total {size(est['total'])}{of}"


def _advice(est: dict, piece: str) -> str:
    bf16 = est["compute_bytes"] >= 4  # run.dtype=bfloat16 would shrink activations and the reference
    if piece == "kv_cache" and est["vllm"]:
        return "lower vllm.kv_cache_gb (vLLM then runs fewer requests at once)"
    if piece == "kv_cache":
        ahead = est["cache_len"] - est["seq_len"]  # rows an SD verify holds past a request's end
        arms = (f"; most of each slot's rows are the {ahead:,} tokens a verify holds past a request's end: lower "
                f"the arms' tokens to verify (spec.strategy, spec.strategies)") if ahead > est["seq_len"] else ""
        return ("lower rollout.max_batch_size (cache slots) or rollout.max_new_tokens (or data.max_prompt_tokens)"
                + arms)
    if piece == "activations":
        options = ["lower rl.micro_batch_tokens"] + ([] if est["grad_checkpointing"] else
                                                    ["set rl.grad_checkpointing=true"]) + (
            ["set run.dtype=bfloat16"] if bf16 else [])
        return ", ".join(options[:-1]) + (" or " if len(options) > 1 else "") + options[-1]
    if piece == "logits":
        return ("lower rl.micro_batch_tokens (the float32 log-softmax over the vocabulary; "
                "rl.grad_checkpointing does not shrink it)")
    if piece == "rollout_activations":
        cause = max(("prefill", "decode", "vllm_step", "drafter_training"), key=lambda k: est.get(k, 0))
        return {"prefill": "lower rollout.max_batch_size (requests admitted and prefilled together), "
                           "data.max_prompt_tokens or data.n_eval (prompts prefilled together)",
                "decode": "lower rollout.max_batch_size (or spec.bs_threshold: rows verified per step)",
                "vllm_step": "lower rollout.max_batch_size (the requests vLLM runs in one step, each with its logits)",
                "drafter_training": "lower spot.tokens_per_step"}[cause]
    if piece == "samples":
        return "lower rollout.prompts_per_step, rollout.group_size, rollout.max_new_tokens or data.n_eval"
    if piece == "reference":
        return "set rl.kl_coef=0 (no reference model)" + (" or run.dtype=bfloat16" if bf16 else "")
    if piece == "drafter":
        return "lower spot.buffer_mb or rollout.max_batch_size, or set spot.train=false"
    if piece == "update_weights":
        return ("set run.dtype=float32 (autocast keeps 16-bit copies of the weights for the backward)"
                if est["compute_bytes"] < est["weight_bytes"] else "start more workers with run.shard=fsdp")
    if piece == "rollout_copy" and est["vllm"] and est["vllm_weight_bytes"] > 2:
        return ("set vllm.dtype=bfloat16 (vLLM's own float32 copy of the policy and the drafter is "
                f"{size(est['vllm_weights'])} of it)")
    if piece == "rollout_copy":
        return ("no setting shrinks it (every worker keeps the whole policy for its engine): use a device with more "
                "memory or a smaller model")
    if est["shard_world"] > 1:  # policy, master, grads, optimizer
        return "start more workers with run.shard=fsdp"
    return "set run.shard=fsdp (shards weights, gradients and AdamW state over the workers)"


NAMES = {"kv_cache": "the KV cache", "activations": "the update's activations", "logits": "the update's logits",
         "rollout_activations": "the rollout's activations", "rollout_copy": "the engine's whole copy of the policy",
         "update_weights": "the update's weight copies", "master": "the fp32 master weights",
         "policy": "the policy's weights", "grads": "the gradients", "optimizer": "the AdamW state",
         "reference": "the reference model", "drafter": "the drafter",
         "samples": "the step's samples"}


def check_fits(est: dict, available: int | None, device_name: str) -> None:
    """Refuse (ConfigError, one line) when the estimated total exceeds the available memory
    less a 10% margin, naming the largest piece and the setting that shrinks it. available
    None (unknown): no check."""
    if available is None:
        return
    usable = int(available * (1 - MARGIN))
    if est["total"] <= usable:
        return
    piece = max(PIECES, key=lambda k: est[k])
    what = _kv(est) if piece == "kv_cache" else size(est[piece])
    raise ConfigError(f"memory: this configuration needs about {size(est['total'])} per worker but {device_name} has "
                      f"{size(available)} available ({size(usable)} after a {MARGIN:.0%} margin); the largest piece is "
                      f"{NAMES[piece]}, {what}: {_advice(est, piece)}")


def available_memory(device_type: str, cuda_free: Callable[[], int | None] | None = None,
                     meminfo: str = MEMINFO) -> int | None:
    """Bytes available on a device, None when unknown (then nothing is refused).

    cpu: the machine's MemAvailable (/proc/meminfo); workers on one machine share it, so
    dividing by the local workers is the caller's business. cuda: `cuda_free()`, which the
    caller takes from `tailtamer.device` (the one module that calls torch.cuda):
    `available_memory(device.type, lambda: device_memory(device))`; without it, None."""
    if device_type == "cuda":
        return cuda_free() if cuda_free is not None else None
    if device_type != "cpu":
        return None
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, unit = line.split()[1:3]
                    return int(value) * 1024 if unit == "kB" else None
    except (OSError, ValueError, IndexError):
        return None
    return None
