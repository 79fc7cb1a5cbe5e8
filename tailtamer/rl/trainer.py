"""`tailtamer train`: GRPO-family RL with verifiable rewards.

`rl_step` is the whole algorithm, top to bottom: rollout -> rewards -> advantages -> old
log-probs (one forward that also yields the hidden states a drafter trains on) -> policy
update -> drafter hook -> weight sync -> metrics. Everything around it (setup, evaluation,
checkpoints, logging) lives in `train`.

Choices: the rollout engine runs the policy module itself (same process), so "weight sync"
is a checksum of what the engine will run next; prompts for step s are drawn from a generator
keyed by (seed, s), and sampling seeds too, so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from tailtamer.atomic import atomic_write_json, atomic_write_text
from tailtamer.config import TrainConfig, to_dict
from tailtamer.errors import TailtamerError
from tailtamer.metrics import RunLog, check_loggers, run_summary
from tailtamer.drafter.buffer import DataBuffer
from tailtamer.drafter.spot import SpotTrainer
from tailtamer.model.drafter import load_drafter, save_drafter, weights_checksum
from tailtamer.model.io import load_model
from tailtamer.model.tokenizer import load_tokenizer
from tailtamer.plots import plot_rl_curves
from tailtamer.rl import grpo
from tailtamer.rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tailtamer.rl.data import load_task_rows
from tailtamer.rl.rewards import RewardScorer, resolve_reward
from tailtamer.rollout.engine import Engine, EngineConfig
from tailtamer.rollout.sampling import SamplingParams
from tailtamer.rollout.speculative import EagleProposer, make_speculator


class TrainingError(TailtamerError):
    """The run cannot go on (e.g. repeated non-finite losses); a checkpoint was written first."""


@dataclass
class RunState:
    cfg: TrainConfig
    run_dir: Path
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    engine: Engine
    scorer: RewardScorer
    train_rows: list[dict]
    eval_rows: list[dict]
    ref_model: torch.nn.Module | None = None
    spot: SpotTrainer | None = None  # the adaptive drafter's trainer, when one will train it
    step: int = 0
    bad_steps: int = 0
    skipped_prompts: int = 0
    history: list[dict] = field(default_factory=list)
    eval_at_start: float | None = None


def rl_step(s: RunState) -> dict:
    cfg, roll, rl = s.cfg, s.cfg.rollout, s.cfg.rl
    t_step = time.perf_counter()

    # 1. Rollout: group_size samples for each of prompts_per_step prompts.
    rng = random.Random(f"{cfg.run.seed}/{s.step}")
    batch = rng.sample(s.train_rows, min(roll.prompts_per_step, len(s.train_rows)))
    params = SamplingParams(temperature=roll.temperature, top_p=roll.top_p, max_new_tokens=roll.max_new_tokens,
                            n=roll.group_size, seed=cfg.run.seed * 1_000_003 + s.step)
    s.model.eval()
    completions, rollout = s.engine.generate([row["prompt_ids"] for row in batch], params)
    rollout_s = time.perf_counter() - t_step

    # 2. Rewards (a failing reward scores 0 and is counted), with the optional overlong penalty.
    correct = torch.tensor([[s.scorer.score(c.text, batch[c.prompt_index]["answer"]) for c in completions]])
    rewards = correct.view(len(batch), roll.group_size).clone()
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float)
    if rl.overlong == "penalty":
        rewards += grpo.overlong_penalty(lengths, roll.max_new_tokens, rl.overlong_buffer).view_as(rewards)

    # 3. Advantages per group; dynamic sampling keeps only groups whose rewards differ.
    advantages = grpo.ADVANTAGES[rl.advantage](rewards).flatten()
    keep = torch.ones(len(completions), dtype=torch.bool)
    if rl.dynamic_sampling:
        keep = grpo.informative_groups(rewards).repeat_interleave(roll.group_size)
    if rl.overlong == "mask":
        keep &= torch.tensor([c.finish_reason != "length" for c in completions])

    # 4. Old log-probs (and the reference's): one forward; its hidden states feed the drafter.
    t_train = time.perf_counter()
    ids, response_mask = response_batch(batch, completions, s.tokenizer.pad_token_id or 0)
    response_mask &= keep[:, None]
    plan = update_plan(response_mask, rl.minibatches, rl.micro_batch_size, roll.max_new_tokens,
                       grpo.AGGREGATIONS[rl.loss_agg], torch.Generator().manual_seed(cfg.run.seed + s.step))
    old_logps, ref_logps = {}, {}
    with torch.no_grad():
        for micro in (m for minibatch in plan for m in minibatch):
            mb_ids = ids[micro.rows, : micro.width]
            logits, hidden = s.model(mb_ids)
            if s.spot is not None:
                s.spot.buffer.add_batch(s.step, mb_ids, hidden, response_mask[micro.rows, : micro.width - 1])
            old_logps[micro.key] = grpo.token_log_probs(logits[:, :-1], mb_ids[:, 1:], roll.temperature)
            if s.ref_model is not None:
                ref_logits = s.ref_model(mb_ids)[0][:, :-1]
                ref_logps[micro.key] = grpo.token_log_probs(ref_logits, mb_ids[:, 1:], roll.temperature)
    del logits

    # 5. Policy update: ppo_epochs passes, one optimizer step per minibatch, gradients
    #    accumulated over its micro-batches (the token weights make the sum exact).
    s.model.train()
    losses, kls, entropies, clip_fracs, grad_norms = [], [], [], [], []
    for _ in range(rl.ppo_epochs):
        for minibatch in plan:
            if not any(m.weights.any() for m in minibatch):
                continue
            s.optimizer.zero_grad(set_to_none=True)
            totals = torch.zeros(4)  # loss, kl, entropy, clipped weight
            for micro in minibatch:
                mb_ids = ids[micro.rows, : micro.width]
                logits, _ = s.model(mb_ids)
                logp = grpo.token_log_probs(logits[:, :-1], mb_ids[:, 1:], roll.temperature)
                per_token, clipped = grpo.clipped_policy_loss(logp, old_logps[micro.key], advantages[micro.rows],
                                                              rl.clip_low, rl.clip_high)
                loss = (per_token * micro.weights).sum()
                kl = entropy = torch.zeros(())
                if s.ref_model is not None:
                    kl = (grpo.KL_ESTIMATORS[rl.kl_estimator](logp, ref_logps[micro.key]) * micro.weights).sum()
                    loss = loss + rl.kl_coef * kl
                if rl.entropy_coef:
                    entropy = (grpo.token_entropy(logits[:, :-1]) * micro.weights).sum()
                    loss = loss - rl.entropy_coef * entropy
                loss.backward()
                totals += torch.stack([loss.detach(), kl.detach(), entropy.detach(),
                                       (clipped * micro.weights).sum().detach()])
            if not torch.isfinite(totals[0]):
                s.bad_steps += 1
                continue  # skip the update, keep the weights
            grad_norms.append(torch.nn.utils.clip_grad_norm_(s.model.parameters(), rl.grad_clip).item())
            s.optimizer.step()
            s.scheduler.step()
            losses.append(totals[0].item())
            kls.append(totals[1].item())
            entropies.append(totals[2].item())
            clip_fracs.append(totals[3].item() / max(1e-12, sum(m.weights.sum().item() for m in minibatch)))
    if losses:
        s.bad_steps = 0
    s.model.eval()
    train_s = time.perf_counter() - t_train

    # 6. Drafter: with one worker, spot training runs in a bounded window after the update.
    drafter = {"steps": 0, "seconds": 0.0, "loss": None}
    if s.spot is not None:
        drafter = s.spot.train(lambda: False, deadline=time.perf_counter() + cfg.drafter.window_s)

    # 7. Weight sync: in one process the engine runs these very modules (the spot trainer
    #    trains the engine's drafter in place); record what the next rollout runs.
    weights = weights_checksum(s.model)
    drafter_sha = weights_checksum(s.engine.proposer.drafter) if isinstance(s.engine.proposer, EagleProposer) else None

    # 8. Metrics.
    summary = rollout.summary()
    sd_tokens = sum(v["tokens"] for v in summary["by_strategy"].values())
    resp = lengths.tolist()
    return {
        "step": s.step,
        "reward_mean": rewards.mean().item(),
        "accuracy": correct.mean().item(),
        "response_len_mean": statistics.mean(resp),
        "response_len_p50": statistics.median(resp),
        "response_len_max": max(resp),
        "truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "rollout_s": rollout_s,
        "train_s": train_s,
        "step_s": time.perf_counter() - t_step,
        "sd_tokens_frac": sd_tokens / max(1, summary["tokens"]),
        "accept_len_mean": summary["accept_len_mean"],
        "drafter_loss": drafter["loss"],
        "drafter_train_s": drafter["seconds"],
        "drafter_steps": drafter["steps"],
        "drafter_buffer_dropped": s.spot.buffer.dropped if s.spot is not None else 0,
        "drafter_sha": drafter_sha,
        "idle_worker_s": 0.0,
        "loss": statistics.mean(losses) if losses else None,
        "kl": statistics.mean(kls) if kls and s.ref_model is not None else None,
        "entropy": statistics.mean(entropies) if entropies and rl.entropy_coef else None,
        "clip_frac": statistics.mean(clip_fracs) if clip_fracs else 0.0,
        "grad_norm": statistics.mean(grad_norms) if grad_norms else None,
        "lr": s.scheduler.get_last_lr()[0],
        "kept_groups_frac": keep.float().mean().item(),
        "skipped_updates": s.bad_steps,
        **s.scorer.counts(),
        "weights_sha": weights,
        "lengths": [int(x) for x in resp],
    }


@dataclass
class MicroBatch:
    key: int
    rows: torch.Tensor  # sample indices
    width: int  # ids[:, :width] holds every token these samples need
    weights: torch.Tensor  # (len(rows), width - 1) aggregation weights of their response tokens


def update_plan(response_mask: torch.Tensor, minibatches: int, micro_batch_size: int, max_len: int,
                aggregation, generator: torch.Generator) -> list[list[MicroBatch]]:
    """Random minibatches (one optimizer step each), each cut into micro-batches of samples of
    similar length trimmed to their longest: padding every sample to the step's longest
    response would waste most of the compute on long-tailed lengths."""
    needed = response_mask.shape[1] - response_mask.flip(1).int().argmax(1) + 1
    needed[~response_mask.any(1)] = 2
    plan, key = [], 0
    for rows in torch.randperm(len(response_mask), generator=generator).chunk(minibatches):
        weights = aggregation(response_mask[rows], max_len)
        rows_by_len = torch.argsort(needed[rows], stable=True)
        micro = []
        for part in rows_by_len.split(micro_batch_size):
            width = int(needed[rows[part]].max())
            micro.append(MicroBatch(key, rows[part], width, weights[part, : width - 1]))
            key += 1
        plan.append(micro)
    return plan


def response_batch(batch, completions, pad_id: int):
    """(ids, mask) with ids = prompt + response per sample, right-padded; mask[b, t] marks
    position t whose next token (ids[b, t + 1]) is a response token, aligned with
    token_log_probs(logits[:, :-1], ids[:, 1:])."""
    seqs = [batch[c.prompt_index]["prompt_ids"] + c.token_ids for c in completions]
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
    for i, (seq, c) in enumerate(zip(seqs, completions)):
        ids[i, : len(seq)] = torch.tensor(seq)
        prompt = len(seq) - len(c.token_ids)
        mask[i, prompt - 1: len(seq) - 1] = True
    return ids, mask


def evaluate_greedy(s: RunState) -> float:
    rows = s.eval_rows
    if not rows:
        return float("nan")
    params = SamplingParams(temperature=0, max_new_tokens=s.cfg.rollout.max_new_tokens)
    completions, _ = s.engine.generate([r["prompt_ids"] for r in rows], params)
    return sum(s.scorer.score(c.text, rows[c.prompt_index]["answer"]) for c in completions) / len(completions)


def _optimizer_factory(cfg: TrainConfig):
    def make(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.rl.lr, betas=(0.9, 0.99),
                                      weight_decay=cfg.rl.weight_decay)
        warmup = max(1, cfg.rl.warmup * cfg.rl.minibatches * cfg.rl.ppo_epochs)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / warmup))
        return optimizer, scheduler

    return make


def _datasets(cfg: TrainConfig, tokenizer):
    """(train rows, eval rows, prompts skipped as too long)."""
    if cfg.data.train == "builtin":
        from tailtamer.demo import HELD_OUT_SEED
        from tailtamer.tasks.arithmetic import ArithmeticTask

        task = ArithmeticTask()
        def rows(problems):
            return [{"prompt_ids": tokenizer.encode(p["prompt"]), "answer": p["answer"]} for p in problems]
        train = rows(task.dataset(cfg.data.n_builtin, seed=cfg.run.seed + 17))
        evals = rows(task.dataset(cfg.data.n_eval, seed=HELD_OUT_SEED)) if cfg.data.eval is None else None
        skipped = 0
    else:
        train, skipped = load_task_rows(cfg.data.train, tokenizer, cfg.data.max_prompt_tokens)
        evals = []
    if cfg.data.eval is not None:
        evals, more = load_task_rows(cfg.data.eval, tokenizer, cfg.data.max_prompt_tokens)
        skipped += more
    return train, evals[: cfg.data.n_eval], skipped


def setup(cfg: TrainConfig, resume: Path | None = None, log=print) -> RunState:
    check_loggers(cfg.run.loggers)
    run_dir = resume or Path(cfg.run.out_dir) / cfg.run.name
    model_dir = Path(cfg.run.model) if cfg.run.model else None
    if model_dir is None:
        from tailtamer.sft import SFTConfig, ensure_base_model

        model_dir = ensure_base_model(SFTConfig(), log=log)
    tokenizer = load_tokenizer(model_dir)
    scorer = RewardScorer(resolve_reward(cfg.rl.reward), cfg.rl.reward_timeout_s)
    train_rows, eval_rows, skipped = _datasets(cfg, tokenizer)
    make_opt = _optimizer_factory(cfg)
    state = {"step": 0}
    if resume is not None:
        checkpoint = latest_checkpoint(run_dir)
        model, optimizer, scheduler, state = load_checkpoint(checkpoint, make_opt)
        log(f"resuming {run_dir} from {checkpoint.name}")
    else:
        model = load_model(model_dir)
        optimizer, scheduler = make_opt(model)
    ref_model = load_model(model_dir).requires_grad_(False) if cfg.rl.kl_coef > 0 else None
    engine = Engine(model, tokenizer, EngineConfig(max_batch_size=cfg.rollout.max_batch_size),
                    **make_speculator(cfg.spec, model))
    spot = None
    # With one worker, a drafter that never trains needs no buffer: nothing fills it.
    if cfg.drafter.train and cfg.drafter.single_worker == "window" and isinstance(engine.proposer, EagleProposer):
        spot = SpotTrainer(engine.proposer.drafter, DataBuffer(cfg.drafter.buffer_mb << 20), cfg.drafter, cfg.run.seed)
        if resume is not None and (checkpoint / "drafter").is_dir():
            engine.proposer.drafter.load_state_dict(load_drafter(checkpoint / "drafter", model).state_dict())
    return RunState(cfg, run_dir, model, tokenizer, optimizer, scheduler, engine, scorer, train_rows, eval_rows,
                    ref_model, spot, step=state["step"], skipped_prompts=skipped)


def _write_run_files(s: RunState) -> None:
    s.run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(s.run_dir / "config.yaml", yaml.safe_dump(to_dict(s.cfg), sort_keys=False))


def _keep_metrics_before(path: Path, step: int) -> list[dict]:
    """On resume, drop rows the interrupted run logged after its last checkpoint."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["step"] < step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _checkpoint(s: RunState) -> None:
    extra = None if s.spot is None else (lambda tmp: save_drafter(s.spot.drafter, tmp / "drafter"))
    save_checkpoint(s.run_dir, s.step, s.model, s.tokenizer, s.optimizer, s.scheduler,
                    {"weights_sha": weights_checksum(s.model)}, extra=extra)


def train(cfg: TrainConfig, resume: Path | None = None, log=print, console=print) -> dict:
    """Run (or resume) `cfg`; `console=None` shows a progress bar with the step lines above it."""
    s = setup(cfg, resume, log)
    if resume is None:
        _write_run_files(s)
    s.history = _keep_metrics_before(s.run_dir / "metrics.jsonl", s.step)
    if s.skipped_prompts:
        log(f"skipped {s.skipped_prompts} prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    if s.step == 0 and cfg.run.eval_every:
        s.eval_at_start = evaluate_greedy(s)
    t0 = time.perf_counter()
    out = RunLog(s.run_dir, cfg.run.loggers, to_dict(cfg), cfg.run.steps, s.step, console)
    try:
        while s.step < cfg.run.steps:
            row = rl_step(s)
            s.step += 1
            if cfg.run.eval_every and (s.step % cfg.run.eval_every == 0 or s.step == cfg.run.steps):
                row["eval_accuracy"] = evaluate_greedy(s)
            out.log(row)
            s.history.append(row)
            if s.bad_steps >= cfg.run.max_bad_steps > 0:
                _checkpoint(s)
                raise TrainingError(f"{s.bad_steps} non-finite losses in a row at step {s.step}; "
                                    f"checkpoint saved in {s.run_dir / 'checkpoints'}")
            if (cfg.run.save_every and s.step % cfg.run.save_every == 0) or s.step == cfg.run.steps:
                _checkpoint(s)
    finally:
        out.close()
    summary = run_summary(s.history, s.eval_at_start, time.perf_counter() - t0, run_dir=str(s.run_dir),
                          skipped_prompts=s.skipped_prompts, **s.scorer.counts())
    atomic_write_json(s.run_dir / "summary.json", summary)
    if s.history:
        plot_rl_curves(s.history, s.run_dir / "curves.png", s.eval_at_start)
    return summary
