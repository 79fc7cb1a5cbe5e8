"""Drafter training: the EAGLE loss on the target's own hidden states.

Offline warm-up (`tailtamer drafter train`) teacher-forces the target over texts and trains
the drafter on each pair (h_j, x_{j+1}) -> (h_{j+1}, p_target(x_{j+2})); the spot trainer
(issue 6) will reuse the same loss on hidden states the RL step already computed.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from tailtamer.atomic import atomic_write_json
from tailtamer.config_fields import f
from tailtamer.device import device_memory
from tailtamer.errors import ConfigError, DataError, TailtamerError
from tailtamer.memory import available_memory, size
from tailtamer.model.drafter import Drafter, init_drafter, save_drafter, weights_checksum
from tailtamer.model.io import load_pretrained
from tailtamer.model.transformer import Transformer
from tailtamer.resumable import Resumable, stopped
from tailtamer.rollout.speculative import MAX_DEPTH
from tailtamer.sft import make_batch
from tailtamer.stopping import StopRequest


class TrainingDiverged(TailtamerError):
    """Training produced non-finite weights."""


@dataclass(frozen=True)
class DrafterTrainConfig:
    steps: int = f(4000, "the built-in drafter's accept length in rollouts (4_1_5, T=1): 2.9 after 800 steps, "
                         "3.5 after 4000, no better after 8000")
    batch_size: int = f(16, "sequences per step")
    lr: float = f(2e-3, "AdamW, linear warm-up then constant (the reference warms up, then holds)")
    warmup: int = f(20, "linear warm-up steps")
    weight_decay: float = f(0.01, "AdamW weight decay")
    value_weight: float = f(1.0, "SmoothL1 on the next hidden state (EAGLE; fastrl's 1.0)")
    prob_weight: float = f(0.1, "soft cross-entropy against the target's next-token distribution (0.1)")
    max_len: int = f(512, "tokens per sequence (longer ones are cut)")
    feature_cache_mb: int = f(2048, "the target's hidden states kept for reuse, so each sequence runs through "
                                    "the target once, not once per step (at most half the free memory); beyond "
                                    "this the target runs every step")
    unroll: int = f(2, "drafting levels trained per pair, the later ones on the drafter's own features (EAGLE-3's "
                       "training-time test; 1: EAGLE-1's teacher forcing). Base model, T=1, coupled chains: accept "
                       "7_1_8 3.15 -> 3.66 at batch 1, 4.16 -> 4.86 at 4 with 2; 3 gave 3.34")
    seed: int = f(0, "data order and initialisation")
    fc_bias: bool = f(True, "a bias in the drafter's fc (EAGLE's); false for vLLM, whose EAGLE loader has none")

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.unroll < 1:
            raise ConfigError("drafter training: steps, batch_size and unroll must be >= 1")
        check_unroll(self.unroll, "drafter training: unroll")
        if self.feature_cache_mb < 0:
            raise ConfigError(f"drafter training: feature_cache_mb must be >= 0, got {self.feature_cache_mb}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"drafter training: lr must be a finite number > 0, got {self.lr}")
        if self.value_weight < 0 or self.prob_weight < 0 or self.value_weight + self.prob_weight == 0:
            raise ConfigError("drafter training: value_weight and prob_weight must be >= 0, not both 0")

    def key(self) -> str:
        """The cache key of what these settings train (the feature cache's budget is memory, not
        training: the drafter comes out the same)."""
        # fc_bias at its default is left out, so the drafters cached before it existed keep their key
        fields = {k: v for k, v in asdict(self).items() if k != "feature_cache_mb" and (k, v) != ("fc_bias", True)}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def eagle_pairs(ids: torch.Tensor, hidden: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor):
    """Align a teacher-forced sequence into drafter pairs (EAGLE; the pairing fastrl's online
    path got wrong, fastrl-code.md §6.3):

        input token x_{j+1} = ids[:, 1:]          input feature h_j = hidden[:, :-1]
        target feature h_{j+1} = hidden[:, 1:]     target logits   = target_logits[:, 1:]
        mask = valid[:, 1:]  (x_{j+1} is a real token, so h_{j+1} is a real position)
    """
    return ids[:, 1:], hidden[:, :-1], hidden[:, 1:], target_logits[:, 1:], valid[:, 1:]


def eagle_loss(pred_hidden, pred_logits, target_hidden, target_logits, mask,
               value_weight: float = 1.0, prob_weight: float = 0.1):
    """L = w_v · SmoothL1(ĥ_{j+1}, h_{j+1}) + w_p · CE(softmax(lm_head(h_{j+1})), lm_head(ĥ_{j+1})),
    each a mean over the masked positions (EAGLE, Li et al. 2024, §4; TLT §2.1).
    Returns (loss, value loss, probability loss)."""
    m = mask.to(pred_hidden.dtype)
    denom = m.sum().clamp(min=1)
    vloss = (F.smooth_l1_loss(pred_hidden, target_hidden, reduction="none").mean(-1) * m).sum() / denom
    target_p = torch.softmax(target_logits.float(), -1)
    ploss = (-(target_p * torch.log_softmax(pred_logits.float(), -1)).sum(-1) * m).sum() / denom
    return value_weight * vloss + prob_weight * ploss, vloss, ploss


def check_unroll(unroll: int, name: str) -> None:
    """Levels beyond the deepest draft (`speculative.MAX_DEPTH`) teach nothing a draft uses, and
    each costs a forward over every position: 1,000 took 98 s a step on the base model."""
    if unroll > MAX_DEPTH:
        raise ConfigError(f"{name} must be at most {MAX_DEPTH}, the deepest draft, got {unroll}")


def unrolled_loss(drafter, tokens, h_in, h_next, target_logits, mask, positions=None, attn=None, unroll: int = 1,
                  value_weight: float = 1.0, prob_weight: float = 0.1):
    """`eagle_loss` summed over `unroll` drafting levels, the later ones fed the drafter's own
    features, as a chain's levels are at inference (the training-time test of EAGLE-3, Li et
    al. 2025, arXiv 2503.01840; EAGLE-1 trains level 1 only, and its deeper levels drift).

    Pairs (B, T) as `eagle_pairs` or `pack` give them: row j is (h_j, x_{j+1}) -> (h_{j+1},
    p(x_{j+2})), `attn` (B, T, T) which rows a row sees (None: causal), `positions` (None: 0..T−1).
    Level m + 1's row j is the pair (ĥ_{j+m}, x_{j+m+1}) at position positions[j] + m, ĥ_{j+m}
    level m's output at row j (detached); it sees level 1's rows i that row j sees (the drafter's
    cache of true features, which a chain's extend fills) and its own ancestors, levels 2..m + 1
    at row j, exactly the rows a chain's level m + 1 attends to. Its targets are row j + m's,
    counted where that row is in the same sequence (attn[j + m, j]) and masked in. The levels
    before the last are computed without gradients; one forward over all `unroll` levels
    (unroll × T rows) carries them. Returns (loss, value loss, probability loss, level 1's
    logits), the two parts summed over levels."""
    if unroll == 1:  # the drafter's own causal default where no mask is given
        logits, hidden = drafter(tokens, h_in, positions, attn)
        return (*eagle_loss(hidden, logits, h_next, target_logits, mask, value_weight, prob_weight), logits)
    B, T = tokens.shape
    dev = tokens.device
    if positions is None:
        positions = torch.arange(T, device=dev).expand(B, T)
    if attn is None:
        attn = torch.ones(T, T, dtype=torch.bool, device=dev).tril().expand(B, T, T)
    # row j of level m + 1 against row j + m: the shifted targets and who counts
    shift = [torch.arange(T, device=dev).add(m).clamp(max=T - 1) for m in range(unroll)]
    counted = [mask if m == 0 else mask[:, shift[m]] & attn[:, shift[m], torch.arange(T, device=dev)]
               & (torch.arange(T, device=dev) + m < T) for m in range(unroll)]
    eye = torch.eye(T, dtype=torch.bool, device=dev).expand(B, T, T)
    none = torch.zeros_like(eye)

    def levels(n: int):
        """Inputs and mask of levels 1..n, level k's features `features[k − 1]`."""
        ids = torch.cat([tokens[:, shift[m]] for m in range(n)], 1)
        pos = torch.cat([positions + m for m in range(n)], 1)
        rows = [torch.cat([attn] + [eye if 1 <= b <= a else none for b in range(1, n)], 2) for a in range(n)]
        return ids, pos, torch.cat(rows, 1)

    features = [h_in]
    with torch.no_grad():
        for n in range(1, unroll):
            ids, pos, both = levels(n)
            _, hidden = drafter(ids, torch.cat(features, 1), pos, both)
            features.append(hidden[:, (n - 1) * T:].detach())
    ids, pos, both = levels(unroll)
    logits, hidden = drafter(ids, torch.cat(features, 1), pos, both)
    loss = vloss = ploss = 0.0
    for m in range(unroll):
        part = slice(m * T, (m + 1) * T)
        lm, vm, pm = eagle_loss(hidden[:, part], logits[:, part], h_next[:, shift[m]], target_logits[:, shift[m]],
                                counted[m], value_weight, prob_weight)
        loss, vloss, ploss = loss + lm, vloss + vm, ploss + pm
    return loss, vloss, ploss, logits[:, :T]


def pack(samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]):
    """Concatenate variable-length pair sequences (tokens_in, hidden_in, hidden_target, mask)
    into one row with no padding (TLT §2.2, sequence packing). Attention stays inside each
    sample (block-diagonal causal mask) and positions restart at 0 per sample, so a packed
    sample sees exactly what it would see alone.

    Returns tokens (1, N), hidden_in (1, N, H), hidden_target (1, N, H), mask (1, N),
    positions (1, N), attn_mask (1, N, N)."""
    lengths, dev = [len(x[0]) for x in samples], samples[0][0].device  # the buffer's device (a GPU's)
    segment = torch.repeat_interleave(torch.arange(len(samples), device=dev), torch.tensor(lengths, device=dev),
                                      output_size=sum(lengths))  # known: no device sync to find it
    positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
    index = torch.arange(len(segment), device=dev)
    attn = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
    cat = [torch.cat([x[i] for x in samples])[None] for i in range(4)]
    return (*cat, positions[None], attn[None])


@torch.no_grad()
def top1_accuracy(pred_logits, target_logits, mask) -> float:
    hit = (pred_logits.argmax(-1) == target_logits.argmax(-1)) & mask
    return hit.sum().item() / max(1, mask.sum().item())


def encode_texts(tokenizer, texts: list[str], max_len: int) -> list[list[int]]:
    return [tokenizer.encode(t)[:max_len] for t in texts if t]


def read_texts(path: str | Path) -> list[str]:
    """JSONL rows with `text`, or `prompt` + `response` (or the built-in task's `trace`)."""
    from tailtamer.jsonl import check_unicode, read_jsonl

    texts = []
    for row in read_jsonl(path):
        if isinstance(row.get("text"), str):
            text = row["text"]
        elif isinstance(row.get("prompt"), str) and isinstance(row.get("response", row.get("trace")), str):
            text = row["prompt"] + row.get("response", row.get("trace"))
        else:
            raise DataError(f"{path}:{row['_row']}: need a string 'text', or 'prompt' and 'response'")
        texts.append(check_unicode(text, f"{path}:{row['_row']}", "text"))
    return texts


def training_state(out_dir: str | Path, target: Transformer, sequences: list[list[int]], cfg: DrafterTrainConfig,
                   drafter: Drafter | None = None) -> Resumable:
    """Where a stopped drafter training into `out_dir` keeps its state, named by what it trains
    from: its config, the target (config and weights), the sequences and the drafter it starts
    from. The weights are read once (about 1 s a GB on a CPU core)."""
    h = hashlib.sha256(json.dumps([cfg.key(), repr(target.config), weights_checksum(target),
                                   None if drafter is None else weights_checksum(drafter)]).encode())
    for seq in sequences:  # as they come: a copy of the whole data as text would double its memory
        h.update(array("q", seq).tobytes() + b"|")
    return Resumable.beside(out_dir, h.hexdigest()[:12])


def train_drafter(target: Transformer, sequences: list[list[int]], cfg: DrafterTrainConfig,
                  drafter: Drafter | None = None, log: Callable[[str], None] = print,
                  state: Resumable | None = None) -> tuple[Drafter, dict]:
    """Train `drafter` (default: a new one) on `sequences` of `target`. A Ctrl-C or SIGTERM stops
    after the step and saves into `state` (`training_state`), from which the next call goes on
    to the drafter an uninterrupted run gives; the finished state is saved there too, for the
    caller to remove once the drafter is written."""
    sequences = [s for s in sequences if len(s) >= 3]
    if not sequences:
        raise DataError("drafter training needs sequences of at least 3 tokens")
    rng = random.Random(cfg.seed)
    # Gradients flow through the shared LM head to the drafter, but never into the target.
    flags = [p.requires_grad for p in target.parameters()]
    target.eval().requires_grad_(False)
    try:
        return _train(target, sequences, cfg, drafter or init_drafter(target, seed=cfg.seed, fc_bias=cfg.fc_bias), rng, log,
                      state)
    finally:
        for p, flag in zip(target.parameters(), flags):
            p.requires_grad_(flag)


def feature_bytes(target: Transformer, sequences: list[list[int]]) -> int:
    """Memory of `target_features`' result: a hidden state per token."""
    return sum(len(s) for s in sequences) * target.config.hidden_size * target.dtype.itemsize


@torch.no_grad()
def target_features(target: Transformer, sequences: list[list[int]], budget_bytes: int,
                    batch_tokens: int = 8192) -> list[torch.Tensor] | None:
    """The target's final hidden states of every sequence, (len, H) each, from forwards over
    length-sorted batches of at most `batch_tokens` padded tokens; None when they would take
    more than `budget_bytes`. The training steps then run only the drafter and the LM head,
    where running the target each step costs its every layer against the drafter's one."""
    if feature_bytes(target, sequences) > budget_bytes:
        return None
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    features: list[torch.Tensor | None] = [None] * len(sequences)
    start = 0
    while start < len(order):
        end = start + 1  # ascending lengths: the chunk's last sequence is its widest
        while end < len(order) and (end + 1 - start) * len(sequences[order[end]]) <= batch_tokens:
            end += 1
        chunk, start = order[start:end], end
        ids, _ = make_batch([(sequences[i], [1] * len(sequences[i])) for i in chunk], 0, target.device)
        hidden = target.hidden_states(ids)
        for j, i in enumerate(chunk):
            features[i] = hidden[j, : len(sequences[i])].clone()
    return features


def feature_budget(cache_mb: int, available: int | None) -> int:
    """Bytes the warm-up may keep in target features: `feature_cache_mb`, but at most half of
    what the device has free (None: unknown, the setting alone), so a large model's cache
    degrades to running the target every step instead of exhausting memory."""
    budget = cache_mb << 20
    return budget if available is None else min(budget, available // 2)


def _train(target, sequences, cfg, drafter, rng, log, state: Resumable | None):
    drafter.train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    # what a state that fails part-way through loading leaves is reset to this
    initial = {k: v.clone() for k, v in drafter.state_dict().items()} if state and state.path.exists() else None
    first, before_s, history = 0, 0.0, []

    def apply(saved: dict) -> None:
        drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["optimizer"])
        rng.setstate((saved["rng"][0], tuple(saved["rng"][1]), saved["rng"][2]))
        torch.set_rng_state(saved["torch_rng"])

    saved = state.resume(apply, log) if state is not None else None
    if saved is not None:
        first, before_s, history = int(saved["step"]), float(saved["seconds"]), [saved["last"]]
    elif initial is not None:  # one that did not load may have half-loaded
        drafter.load_state_dict(initial)
        opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        rng.seed(cfg.seed)

    t0 = time.perf_counter() - before_s
    features = None
    if first < cfg.steps:  # a finished state needs no step
        # the cached features and the target run every step agree to 7 digits, not to the bit: a
        # resumed training takes the path its first part took
        features = _features(target, sequences, cfg, log, saved.get("cached") if saved is not None else None)

    def save(step: int) -> str:
        return state.save({"step": step, "seconds": time.perf_counter() - t0, "last": history[-1],
                           "cached": features is not None, "drafter": drafter.state_dict(),
                           "optimizer": opt.state_dict(), "rng": rng.getstate(), "torch_rng": torch.get_rng_state()})

    with StopRequest(log=log) as stop:
        for step in range(first, cfg.steps):
            _step(target, sequences, features, cfg, drafter, opt, rng, step, history, log, t0)
            if stop.requested and step + 1 < cfg.steps:
                raise stopped(stop.reason, step + 1, cfg.steps, "the drafter's training",
                              "" if state is None else save(step + 1))
        drafter.eval()
        if not all(torch.isfinite(p).all() for p in drafter.parameters()):
            if state is not None:  # going on from it would diverge again
                state.remove(log)
            raise TrainingDiverged(f"drafter training diverged (loss {history[-1]['loss']}); nothing was written: "
                                   f"try a lower --lr than {cfg.lr}")
        if state is not None and first < cfg.steps:
            save(cfg.steps)
    return drafter, {"config": asdict(cfg), "seconds": time.perf_counter() - t0, "final": history[-1]}


def _features(target, sequences, cfg, log, cached: bool | None) -> list[torch.Tensor] | None:
    """The target's hidden states of `sequences` when they fit the budget (`target_features`);
    `cached`: the choice a stopped training made, kept (True where they no longer fit: said)."""
    if cached is False:
        return None
    device = target.device
    budget = feature_budget(cfg.feature_cache_mb, available_memory(device.type, lambda: device_memory(device)))
    if feature_bytes(target, sequences) <= budget:  # a minute or more on a CPU, before the first step
        log(f"drafter training: the target's hidden states of {len(sequences)} sequences "
            f"({sum(map(len, sequences)):,} tokens), once")
    features = target_features(target, sequences, budget)
    if features is None and cached:
        log("drafter training: the target's features no longer fit the memory they took before the stop: the "
            "target runs at every step, which agrees with them to about 7 digits, not to the bit")
    elif features is None and cfg.feature_cache_mb:  # 0: the user turned the cache off
        log(f"drafter training: the target's features take {size(feature_bytes(target, sequences))}, over the "
            f"{size(budget)} budget (feature_cache_mb, at most half the free memory): the target runs at every "
            f"step instead")
    return features


def _step(target, sequences, features, cfg, drafter, opt, rng, step, history, log, t0) -> None:
    """One optimizer step of the drafter on a batch of similar-length sequences."""
    # Batches of similar length waste less on padding (lengths are long-tailed).
    pool = sorted(rng.sample(range(len(sequences)), min(len(sequences), cfg.batch_size * 4)),
                  key=lambda i: len(sequences[i]))
    start = rng.randrange(0, max(1, len(pool) - cfg.batch_size + 1))
    chosen = pool[start: start + cfg.batch_size]
    ids, valid = make_batch([(sequences[i], [1] * len(sequences[i])) for i in chosen], 0, target.device)
    with torch.no_grad():
        if features is None:
            t_logits, hidden = target(ids)
        else:  # the final hidden states are post-norm: the LM head alone gives the logits
            hidden = torch.nn.utils.rnn.pad_sequence([features[i] for i in chosen], batch_first=True)
            t_logits = target.lm_head(hidden)
    x, h_in, h_next, logits_next, mask = eagle_pairs(ids, hidden, t_logits, valid)
    loss, vloss, ploss, pred_logits = unrolled_loss(drafter, x, h_in, h_next, logits_next, mask, unroll=cfg.unroll,
                                                    value_weight=cfg.value_weight, prob_weight=cfg.prob_weight)
    for g in opt.param_groups:
        g["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    opt.step()
    acc = top1_accuracy(pred_logits, logits_next, mask)
    history.append({"step": step, "loss": loss.item(), "vloss": vloss.item(), "ploss": ploss.item(), "top1": acc})
    if step % 50 == 0 or step == cfg.steps - 1:
        log(f"drafter step {step:4d}/{cfg.steps}  loss {loss.item():.4f}  top-1 {acc:.1%}  "
            f"{time.perf_counter() - t0:5.1f}s")


def ensure_builtin_drafter(model_dir: Path, cfg: DrafterTrainConfig = DrafterTrainConfig(),
                           log: Callable[[str], None] = print) -> Path:
    """The directory of the built-in base model's warmed-up drafter, trained on task traces
    once and cached beside the model (which is only loaded to train it)."""
    from tailtamer.tasks.arithmetic import ArithmeticTask

    out = model_dir.parent / f"{model_dir.name}-drafter-{cfg.key()}"
    if not (out / "train.json").is_file():
        log(f"warming up a drafter for {model_dir} into {out}")
        target, tokenizer = load_pretrained(model_dir)
        problems = ArithmeticTask().dataset(4000, seed=cfg.seed + 7)
        seqs = encode_texts(tokenizer, [p["prompt"] + p["trace"] for p in problems], cfg.max_len)
        state = training_state(out, target, seqs, cfg)
        drafter, info = train_drafter(target, seqs, cfg, log=log, state=state)
        save_drafter(drafter, out)
        atomic_write_json(out / "train.json", info)
        state.remove(log)
    return out
