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
from tailtamer.model.drafter import weights_checksum
from tailtamer.model.io import load_model
from tailtamer.model.tokenizer import load_tokenizer
from tailtamer.rl import grpo
from tailtamer.rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tailtamer.rl.data import load_task_rows
from tailtamer.rl.rewards import RewardScorer, resolve_reward
from tailtamer.rollout.engine import Engine, EngineConfig
from tailtamer.rollout.sampling import SamplingParams
from tailtamer.rollout.speculative import make_speculator


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
    #    Minibatches hold samples of similar length (trimmed to their longest), since padding
    #    every sample to the longest response of the step would waste most of the compute.
    t_train = time.perf_counter()
    ids, response_mask = response_batch(batch, completions, s.tokenizer.pad_token_id or 0)
    response_mask &= keep[:, None]
    seq_len = response_mask.shape[1] - response_mask.flip(1).int().argmax(1) + 1
    by_length = torch.argsort(seq_len, stable=True)
    minibatches = []
    for mb in by_length.chunk(rl.minibatches):
        width = int(seq_len[mb].max())
        minibatches.append((mb, ids[mb, :width], response_mask[mb, : width - 1]))
    old_logps, ref_logps, hiddens = [], [], []
    with torch.no_grad():
        for _, mb_ids, _ in minibatches:
            logits, hidden = s.model(mb_ids)
            old_logps.append(grpo.token_log_probs(logits[:, :-1], mb_ids[:, 1:], roll.temperature))
            hiddens.append(hidden)
            if s.ref_model is not None:
                ref_logps.append(grpo.token_log_probs(s.ref_model(mb_ids)[0][:, :-1], mb_ids[:, 1:], roll.temperature))
    del logits

    # 5. Policy update: ppo_epochs passes of `minibatches` optimizer steps.
    s.model.train()
    losses, kls, entropies, clip_fracs, grad_norms = [], [], [], [], []
    aggregate = grpo.AGGREGATIONS[rl.loss_agg]
    visit = torch.randperm(len(minibatches), generator=torch.Generator().manual_seed(cfg.run.seed + s.step))
    for _ in range(rl.ppo_epochs):
        for k in visit.tolist():
            mb, mb_ids, mask = minibatches[k]
            if not mask.any():
                continue
            logits, _ = s.model(mb_ids)
            logp = grpo.token_log_probs(logits[:, :-1], mb_ids[:, 1:], roll.temperature)
            per_token, clipped = grpo.clipped_policy_loss(logp, old_logps[k], advantages[mb], rl.clip_low, rl.clip_high)
            loss = aggregate(per_token, mask, roll.max_new_tokens)
            if s.ref_model is not None:
                kl = aggregate(grpo.KL_ESTIMATORS[rl.kl_estimator](logp, ref_logps[k]), mask, roll.max_new_tokens)
                loss = loss + rl.kl_coef * kl
                kls.append(kl.item())
            if rl.entropy_coef:
                entropy = aggregate(grpo.token_entropy(logits[:, :-1]), mask, roll.max_new_tokens)
                loss = loss - rl.entropy_coef * entropy
                entropies.append(entropy.item())
            s.optimizer.zero_grad(set_to_none=True)
            if not torch.isfinite(loss):
                s.bad_steps += 1
                continue  # skip the update, keep the weights
            loss.backward()
            grad_norms.append(torch.nn.utils.clip_grad_norm_(s.model.parameters(), rl.grad_clip).item())
            s.optimizer.step()
            s.scheduler.step()
            losses.append(loss.item())
            clip_fracs.append((clipped & mask).sum().item() / mask.sum().item())
    if losses:
        s.bad_steps = 0
    s.model.eval()
    train_s = time.perf_counter() - t_train

    # 6. Drafter hook: training on idle workers arrives with the spot trainer (no-op for now).
    drafter_loss, drafter_train_s = None, 0.0
    del hiddens

    # 7. Weight sync: the engine runs this very module; record what it will run next.
    weights = weights_checksum(s.model)

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
        "drafter_loss": drafter_loss,
        "drafter_train_s": drafter_train_s,
        "idle_worker_s": 0.0,
        "loss": statistics.mean(losses) if losses else None,
        "kl": statistics.mean(kls) if kls else None,
        "entropy": statistics.mean(entropies) if entropies else None,
        "clip_frac": statistics.mean(clip_fracs) if clip_fracs else 0.0,
        "grad_norm": statistics.mean(grad_norms) if grad_norms else None,
        "lr": s.scheduler.get_last_lr()[0],
        "kept_groups_frac": keep.float().mean().item(),
        "skipped_updates": s.bad_steps,
        **s.scorer.counts(),
        "weights_sha": weights,
        "lengths": [int(x) for x in resp],
    }


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
    s = RunState(cfg, run_dir, model, tokenizer, optimizer, scheduler, engine, scorer, train_rows, eval_rows,
                 ref_model, step=state["step"], skipped_prompts=skipped)
    return s


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
    save_checkpoint(s.run_dir, s.step, s.model, s.tokenizer, s.optimizer, s.scheduler,
                    {"weights_sha": weights_checksum(s.model)})


def train(cfg: TrainConfig, resume: Path | None = None, log=print) -> dict:
    s = setup(cfg, resume, log)
    if resume is None:
        _write_run_files(s)
    metrics_path = s.run_dir / "metrics.jsonl"
    s.history = _keep_metrics_before(metrics_path, s.step)
    if s.skipped_prompts:
        log(f"skipped {s.skipped_prompts} prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    if s.step == 0 and cfg.run.eval_every:
        s.eval_at_start = evaluate_greedy(s)
    t0 = time.perf_counter()
    with open(metrics_path, "a", encoding="utf-8") as out:
        while s.step < cfg.run.steps:
            row = rl_step(s)
            s.step += 1
            if cfg.run.eval_every and (s.step % cfg.run.eval_every == 0 or s.step == cfg.run.steps):
                row["eval_accuracy"] = evaluate_greedy(s)
            out.write(json.dumps(row) + "\n")
            out.flush()
            s.history.append(row)
            log(_console_line(row, cfg.run.steps))
            if s.bad_steps >= cfg.run.max_bad_steps > 0:
                _checkpoint(s)
                raise TrainingError(f"{s.bad_steps} non-finite losses in a row at step {s.step}; "
                                    f"checkpoint saved in {s.run_dir / 'checkpoints'}")
            if (cfg.run.save_every and s.step % cfg.run.save_every == 0) or s.step == cfg.run.steps:
                _checkpoint(s)
    summary = _summary(s, time.perf_counter() - t0)
    atomic_write_json(s.run_dir / "summary.json", summary)
    _plots(s)
    return summary


def _console_line(row: dict, steps: int) -> str:
    extra = f"  eval {row['eval_accuracy']:.1%}" if "eval_accuracy" in row else ""
    return (f"step {row['step'] + 1:4d}/{steps}  reward {row['reward_mean']:.3f}  acc {row['accuracy']:.1%}  "
            f"len p50 {row['response_len_p50']:.0f} max {row['response_len_max']:.0f}  "
            f"rollout {row['rollout_s']:.1f}s train {row['train_s']:.1f}s{extra}")


def _summary(s: RunState, seconds: float) -> dict:
    h = s.history
    evals = [r["eval_accuracy"] for r in h if "eval_accuracy" in r]
    first = h[: max(1, len(h) // 5)]
    last = h[-max(1, len(h) // 5):]
    return {
        "run_dir": str(s.run_dir), "steps": len(h), "seconds": seconds,
        "accuracy_first_steps": statistics.mean(r["accuracy"] for r in first) if h else None,
        "accuracy_last_steps": statistics.mean(r["accuracy"] for r in last) if h else None,
        "eval_accuracy_start": s.eval_at_start,
        "eval_accuracy_end": evals[-1] if evals else None,
        "step_s_median": statistics.median(r["step_s"] for r in h) if h else None,
        "skipped_prompts": s.skipped_prompts, **s.scorer.counts(),
    }


def _plots(s: RunState) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = s.history
    if not h:
        return
    steps = [r["step"] + 1 for r in h]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5), dpi=110)
    a.plot(steps, [r["reward_mean"] for r in h], label="reward (train samples)")
    a.plot(steps, [r["accuracy"] for r in h], label="accuracy (train samples)")
    ev = [(r["step"] + 1, r["eval_accuracy"]) for r in h if "eval_accuracy" in r]
    if ev:
        a.plot(*zip(*ev), "o-", label="greedy accuracy (held out)")
    a.set_xlabel("step")
    a.legend(fontsize=8)
    b.boxplot([r["lengths"] for r in h], positions=steps, widths=0.6, showfliers=True)
    b.set_xlabel("step")
    b.set_ylabel("response length (tokens)")
    fig.tight_layout()
    fig.savefig(s.run_dir / "curves.png")
    plt.close(fig)
