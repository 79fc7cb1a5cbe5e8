"""`tailtamer sft`: train the built-in task's tiny base model on reference traces.

Two phases. First the model learns to work problems out, one step per line, from worked
traces. Then, for `habit_steps` more steps at the final learning rate, its teacher skips the
working for a `direct_answer_prob` share of the problems and states only `answer: N`, the way
much of a real base model's data states results without the reasoning. The base model ends up
answering most prompts directly, which is nearly always wrong, while the working it can
still do is right about four times in ten: a habit that RL from the outcome reward
has a clear reason to unlearn (the R1-Zero story in miniature: accuracy rises as responses
get longer). Without the habit, the errors left are ones no small RL budget fixes (the model
copies the wrong operation from long prompts; README, "why the base model has a habit").

Training is reproducible from the seed and the result is cached under a directory keyed by
the config's hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from tailtamer.atomic import atomic_write, atomic_write_json
from tailtamer.config_fields import f
from tailtamer.errors import ConfigError
from tailtamer.model.config import preset_config
from tailtamer.model.io import init_model, save_model
from tailtamer.model.tokenizer import Tokenizer, char_tokenizer
from tailtamer.resumable import Resumable, stopped
from tailtamer.stopping import StopRequest
from tailtamer.tasks.arithmetic import ArithmeticTask

CACHE_ENV = "TAILTAMER_CACHE"
# Bump when the training data or procedure changes for the same config, so caches refresh.
RECIPE_VERSION = 3


@dataclass(frozen=True)
class SFTConfig:
    preset: str = f("base", "model size (see model.config.PRESETS)")
    steps: int = f(1000, "optimizer steps on worked traces (~8 min on 2 cores)")
    habit_steps: int = f(150, "then steps at the final learning rate with the teacher's direct answers")
    direct_answer_prob: float = f(0.6, "share of those problems the teacher answers without working")
    batch_size: int = f(32, "problems per step")
    lr: float = f(3e-3, "peak AdamW learning rate (linear warm-up, cosine decay to 10%)")
    warmup: int = f(30, "linear warm-up steps")
    weight_decay: float = f(0.01, "AdamW weight decay")
    seed: int = f(0, "data order and initialisation")
    task: ArithmeticTask = field(default_factory=ArithmeticTask, metadata={"help": "the built-in task it learns"})

    def __post_init__(self):
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"sft.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"sft.lr must be > 0, got {self.lr}")
        if self.habit_steps < 0:
            raise ConfigError(f"sft.habit_steps must be >= 0, got {self.habit_steps}")
        if not 0 <= self.direct_answer_prob <= 1:
            raise ConfigError(f"sft.direct_answer_prob must be in [0, 1], got {self.direct_answer_prob}")

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "recipe": RECIPE_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cache_root() -> Path:
    """Absolute, as a run's config.yaml names the built-in model by it and resumes from anywhere."""
    return Path(os.path.abspath(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tailtamer"))


def encode_example(tok: Tokenizer, problem: dict) -> tuple[list[int], list[int]]:
    """(ids, loss mask): the prompt is context only; the trace and EOS are learned."""
    prompt, response = tok.encode(problem["prompt"]), tok.encode(problem["trace"]) + [tok.eos_token_id]
    return prompt + response, [0] * len(prompt) + [1] * len(response)


def make_batch(examples: list[tuple[list[int], list[int]]], pad_id: int, device=None):
    """Right-pad (ids, mask) examples to (B, T) tensors: ids and a bool mask (False on pads)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(examples), width), dtype=torch.bool, device=device)
    for i, (x, m) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
    return ids, mask


def teacher_response(problem: dict, rng: random.Random, direct_prob: float) -> dict:
    """The problem with the teacher's response as its trace: the worked trace, or with
    probability direct_prob only the final `answer: N` line."""
    if direct_prob and rng.random() < direct_prob:
        return {**problem, "trace": f"answer: {problem['answer']}"}
    return problem


def length_bucketed_batches(tok: Tokenizer, cfg: SFTConfig, rng: random.Random, pool: int = 8,
                            direct_prob: float = 0.0):
    """Endless batches of similar-length examples: with long-tailed lengths, padding every
    batch to its longest member would waste most of the compute."""
    while True:
        examples = sorted((encode_example(tok, teacher_response(cfg.task.sample(rng), rng, direct_prob))
                           for _ in range(pool * cfg.batch_size)), key=lambda e: len(e[0]))
        chunks = [examples[i: i + cfg.batch_size] for i in range(0, len(examples), cfg.batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield make_batch(chunk, tok.pad_token_id)


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Linear warm-up, cosine decay to 10% over `steps`, then 10% through the habit phase."""
    if step >= cfg.steps:
        return 0.1 * cfg.lr
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def training_state(out_dir: str | Path, cfg: SFTConfig) -> Resumable:
    """Where a stopped `train_sft` of `cfg` into `out_dir` keeps its state."""
    return Resumable.beside(out_dir, cfg.key())


def train_sft(cfg: SFTConfig, out_dir: str | Path, log: Callable[[str], None] = print,
              partial: Resumable | None = None) -> dict:
    """Train the base model into `out_dir`. A Ctrl-C or SIGTERM stops after the step and saves
    the state into `partial` (a file, `training_state`), from which the next call goes on: the
    model, AdamW's state and the data stream where they were, so the result is the same as an
    uninterrupted run's (a second Ctrl-C stops at once, saving nothing). The finished state is
    saved there too, for the caller to remove once the model is in place: a model that cannot
    be moved there is not lost."""
    tok = char_tokenizer()
    model_cfg = preset_config(cfg.preset, tok.vocab_size, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    model, opt = _fresh_model(cfg, model_cfg)
    total, start, loss_ema, before_s = cfg.steps + cfg.habit_steps, 0, None, 0.0

    def apply(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])

    state = partial.resume(apply, log) if partial is not None else None
    if state is not None:
        start, loss_ema, before_s = int(state["step"]), float(state["loss_ema"]), float(state["seconds"])
    elif partial is not None and partial.path.exists():  # one that did not load may have half-loaded
        model, opt = _fresh_model(cfg, model_cfg)
    t0, rng = time.perf_counter() - before_s, random.Random(cfg.seed)
    worked = length_bucketed_batches(tok, cfg, rng)
    habit = length_bucketed_batches(tok, cfg, rng, direct_prob=cfg.direct_answer_prob)
    for step in range(start):  # the data stream where it was: both streams draw from one rng
        next(worked if step < cfg.steps else habit)
    with StopRequest(log=log) as stop:
        for step in range(start, total):
            ids, mask = next(worked if step < cfg.steps else habit)
            logits, _ = model(ids[:, :-1])
            target_mask = mask[:, 1:]
            loss = F.cross_entropy(logits[target_mask], ids[:, 1:][target_mask])
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
            if step % 50 == 0 or step == total - 1:
                log(f"sft step {step + 1:4d}/{total}  loss {loss_ema:.4f}  {time.perf_counter() - t0:6.1f}s")
            if stop.requested and step + 1 < total:
                saved = "" if partial is None else _save_partial(partial, model, opt, step + 1, loss_ema,
                                                                 time.perf_counter() - t0)
                raise stopped(stop.reason, step + 1, total, "the base model's training", saved)
        if partial is not None and start < total:
            _save_partial(partial, model, opt, total, loss_ema, time.perf_counter() - t0)
        model.eval()  # the last step done: a stop now waits for the model's files, which are the rest
        out_dir = Path(out_dir)
        save_model(model, out_dir)
        tok.save(out_dir)
        info = {"config": asdict(cfg), "final_loss": loss_ema, "seconds": time.perf_counter() - t0,
                "parameters": model_cfg.num_parameters()}
        atomic_write_json(out_dir / "sft.json", info)
    return info


def _save_partial(partial: Resumable, model, opt, step: int, loss_ema: float, seconds: float) -> str:
    return partial.save({"step": step, "loss_ema": loss_ema, "seconds": seconds, "model": model.state_dict(),
                         "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state()})


def _fresh_model(cfg: SFTConfig, model_cfg):
    """(model, AdamW) as training starts them, from the seed."""
    torch.manual_seed(cfg.seed)
    model = init_model(model_cfg, seed=cfg.seed).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    return model, opt


def _byte_level_tokenizer(model_dir: Path) -> None:
    """A base model cached before 2026-12-05 holds the character tokenizer as a plain
    vocabulary, which transformers ≥ 5 reads without spaces and newlines; it becomes today's
    byte-level form, with the same ids (tests/test_tokenizer.py). A cache this process cannot
    write keeps its file: tailtamer reads both."""
    path = model_dir / "tokenizer.json"
    try:
        if json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") is None:
            atomic_write(path, lambda tmp: char_tokenizer().backend.save(tmp))
    except (OSError, ValueError):
        pass


def ensure_base_model(cfg: SFTConfig = SFTConfig(), log: Callable[[str], None] = print) -> Path:
    """The cached base model for `cfg`, trained first if it is not there yet.

    Training writes into a temporary sibling directory that is renamed into place at the end,
    so an interrupted run never leaves a half-written model in the cache.
    """
    target = cache_root() / f"base-{cfg.preset}-{cfg.key()}"
    if (target / "sft.json").is_file():
        _byte_level_tokenizer(target)
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(target.parent, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        why = "it is a file" if target.parent.is_file() else e.strerror or e  # mkdir says "File exists"
        raise ConfigError(f"cannot write the base model into {target.parent} ({why}); set {CACHE_ENV} "
                          f"to a writable directory") from None
    log(f"training the base model into {target} (cached for later runs)")
    write_base_model(cfg, target, log, existing="keep")  # another process may finish first
    return target


def write_base_model(cfg: SFTConfig, out_dir: Path, log: Callable[[str], None] = print,
                     existing: str = "empty") -> dict:
    """`train_sft` into `out_dir` through a hidden sibling (`write_dir`, `existing` as there),
    then the training's saved state removed; a write that fails is one line, which says where
    the state is kept when it is (the same call then writes the model from it)."""
    partial, info = training_state(out_dir, cfg), {}
    partial.write(out_dir, lambda tmp: info.update(train_sft(cfg, tmp, log, partial)), "the base model", log, existing)
    return info
