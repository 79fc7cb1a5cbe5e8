"""`tailtamer train`: GRPO-family RL with verifiable rewards, on one or more workers.

`rl_step` is the whole algorithm, top to bottom: rollout (each worker a shard of the prompts;
its forwards' hidden states feed the drafter) -> its rewards, scored at once -> spot training
of the drafter on workers whose shard is done, preempted when the last one finishes -> reward
failures checked over all workers -> advantages -> old log-probs (the on-policy first
minibatch's from the update's own forward, later minibatches' from one no-grad forward) ->
data-parallel policy update (samples of advantage 0 skipped: their gradient is 0) -> drafter
publish -> weight check -> metrics. Everything around it (evaluation, checkpoints, logging)
lives in `train`; what a worker loads for a run, in tailtamer/rl/run_state.py; processes and
the c10d store, in tailtamer/dist.py.

Choices: each worker's rollout engine runs its own copy of the policy module, and every worker
applies the same summed gradient, so "weight sync" is a checksum of what every engine will run
next, compared across workers. Step s takes the next prompts of shuffled passes over the data
(`PromptOrder`, a function of (seed, s)) and samples from streams keyed by (seed, s, global
prompt index, sample): a resumed run repeats an uninterrupted one, and N workers sample what
one worker would.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import yaml

from tailtamer.atomic import atomic_write_json, atomic_write_text, writing
from tailtamer.config import TrainConfig, to_dict
from tailtamer.device import autocast, gpu_count, resolve_device, train_device
from tailtamer.dist import Workers, resolve_workers, spawn, torchrun_env
from tailtamer.errors import ConfigError, TailtamerError, WriteError
from tailtamer.metrics import RunLog, run_summary
from tailtamer.model.drafter import weights_checksum
from tailtamer.pace import NoPace
from tailtamer.plots import plot_accept_lengths, plot_rl_curves, plot_worker_timeline
from tailtamer.rl import grpo
from tailtamer.rl.batching import Samples, minibatch_of, rebalance, response_batch, update_plan
from tailtamer.rl.checkpoint import resumable_hint, save_checkpoint
from tailtamer.rl.rewards import merge_failures
from tailtamer.rl.run_dir import (claim_run_dir, keep_metrics_through, record_resume, resume_changes, resume_note,
                                  run_settings)
from tailtamer.rl.run_state import (RunState, check_startable, prepare, prompt_limit, run_dir_of, say_unread, setup,
                                    training_prompts)
from tailtamer.rl.step_metrics import StepClock, logs_samples, merge as merge_step_metrics, sample_log, worker_share
from tailtamer.rollout.backend import RolloutBackendError
from tailtamer.rollout.draft_history import FILE as HISTORY_FILE, save_histories
from tailtamer.rollout.engine import NonFiniteLogits
from tailtamer.rollout.sampling import SamplingParams
from tailtamer.rollout.vllm_backend import require_vllm
from tailtamer.stopping import Interrupted, StopRequest


class TrainingError(TailtamerError):
    """The run cannot go on (repeated non-finite losses, workers running different weights)."""


class StepAborted(TrainingError):
    """A step cannot go on; raised on every worker before it changed any weights, so the state
    between the two steps can still be checkpointed."""


def reward_items(rows: list[dict], completions: list) -> list[tuple[str, str, dict]]:
    """(response, answer, row context) per completion of `rows` (completion prompt indices
    count within `rows`), as the reward scorer takes them."""
    return [(c.text, rows[c.prompt_index]["answer"], rows[c.prompt_index].get("context", {})) for c in completions]


def checked_rewards(s: RunState, scored: list[list[tuple[float, bool]]]) -> tuple[torch.Tensor, dict]:
    """This worker's rewards from its scored calls (`RewardScorer.score_calls`: the reward
    functions' weighted sum, a failed call counting 0), and each function's values by name.
    If one function failed on every sample of the step on every worker, StepAborted: its
    zeros teach nothing and a run that trains on them hides the bug."""
    names = s.scorer.names
    failed = [sum(not parts[j][1] for parts in scored) for j in range(len(names))]
    gathered = s.workers.gather((failed, len(scored), s.scorer.failures))
    total = sum(g[1] for g in gathered)
    for j, name in enumerate(names):
        if sum(g[0][j] for g in gathered) == total:
            kinds = merge_failures([g[2] for g in gathered]).values()
            mine = [e["first"] for e in kinds if len(names) == 1 or e["first"].startswith(f"{name}: ")]
            raise StepAborted(f"every reward of step {s.step + 1} failed ({total} of {total} samples; rl.reward "
                              f"{name}): " + "; ".join(mine or [e["first"] for e in kinds]))
    by_name = {name: [parts[j][0] for parts in scored] for j, name in enumerate(names)}
    return torch.tensor([s.scorer.total(parts)[0] for parts in scored]), by_name


def rl_step(s: RunState) -> dict:
    cfg, roll, rl, w = s.cfg, s.cfg.rollout, s.cfg.rl, s.workers
    clock = StepClock()

    # 1. Rollout: group_size samples for each of prompts_per_step prompts; this worker
    #    generates a contiguous shard of the prompts, each from its global sampling stream.
    prompts = [s.train_rows[i] for i in s.order.indices(s.step)]
    lo, hi = w.shard(len(prompts))
    batch = prompts[lo:hi]
    params = SamplingParams(temperature=roll.temperature, top_p=roll.top_p, max_new_tokens=roll.max_new_tokens,
                            n=roll.group_size, seed=cfg.run.seed * 1_000_003 + s.step)
    s.model.eval()
    w.set_state("BUSY")
    # the drafter's data: the rollout's own hidden states where the backend hands them over
    keep_hidden = s.drafter.collector(s.step) if s.rollout.hidden_states else None
    try:
        completions, rollout = s.rollout.generate([row["prompt_ids"] for row in batch], params, first_index=lo,
                                                  keep_hidden=keep_hidden)
    except RolloutBackendError as e:  # the engine died or failed: nothing of this step is applied
        raise TrainingError(f"step {s.step + 1}: {e}; {_resume_hint(s)}") from None
    except NonFiniteLogits as e:
        raise _diverged(s, f"step {s.step + 1}'s rollout", e) from None
    clock.mark("rollout")
    w.finish_rollout(s.step)

    # 2. This worker's rewards, scored as soon as its shard is done: on a worker that finished
    #    early that is idle time, so only the last worker's scoring is on the critical path.
    scored = s.scorer.score_calls(reward_items(batch, completions))
    clock.mark("rewards")

    # 3. Idle time: until the last shard is done, the drafter scores itself on the newest
    #    responses and trains on the buffer; it checks the store before every drafter step.
    drafter = None  # the spot trainer's report, if it trained
    if s.drafter.trains and w.world > 1 and not w.rollout_over(s.step):
        w.set_state("TRAINING")
        drafter = s.drafter.train_while_idle(lambda: w.rollout_over(s.step))
        clock.mark("spot")
    w.set_state("IDLE")

    # 4. Every worker's reward failures counted together (a failing reward scores 0; when
    #    every one fails the run stops here, before the update), the optional overlong penalty.
    #    The last worker may still be rolling out or scoring: meet at a store barrier first,
    #    which has no collective timeout (a long tail or a slow verifier may take longer than
    #    run.dist_timeout_s); past it every shard is done, so the rollouts' end is stamped.
    w.wait_for_all("rewards")
    last_rollout_end = w.wait_rollout(s.step)
    clock.mark("wait")
    # Every worker's idle-time drafter steps are over: their average travels during the update.
    published = s.drafter.publish(drafter["steps"] if drafter else 0)
    total, by_function = checked_rewards(s, scored)
    correct = torch.tensor(next(iter(by_function.values())))  # accuracy: the first function, unweighted
    rewards = total.view(len(batch), roll.group_size).clone()
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float)
    if rl.overlong == "penalty":
        rewards += grpo.overlong_penalty(lengths, roll.max_new_tokens, rl.overlong_buffer).view_as(rewards)

    # 5. Advantages per group (a group never spans workers); dynamic sampling keeps only
    #    groups whose rewards differ, overlong masking only untruncated samples (for the
    #    policy loss: the drafter learns from every response).
    advantages = grpo.ADVANTAGES[rl.advantage](rewards).flatten()
    keep = torch.ones(len(completions), dtype=torch.bool)
    if rl.dynamic_sampling:
        keep = grpo.informative_groups(rewards).repeat_interleave(roll.group_size)
    if rl.overlong == "mask":
        keep &= torch.tensor([c.finish_reason != "length" for c in completions], dtype=torch.bool)
    clock.mark("rewards")

    # 6. Old log-probs (and the reference's): a no-grad forward for every minibatch but the
    #    on-policy first (its update forward gives them). Workers first re-deal the samples so
    #    each holds about as many tokens to compute: a sample of advantage 0 has a policy-loss
    #    gradient of exactly 0, so (without KL and entropy terms) no forward computes it.
    ids, response_mask = response_batch(batch, completions, s.tokenizer.pad_token_id or 0)
    first = lo * roll.group_size
    n_total = len(prompts) * roll.group_size
    shuffle = lambda: torch.Generator().manual_seed(cfg.run.seed + s.step)  # noqa: E731 (the step's minibatches)
    skip = rl.skips_zero_advantage
    samples = rebalance(w, Samples(ids, response_mask, keep, advantages, torch.arange(first, first + len(completions))),
                        s.tokenizer.pad_token_id or 0,
                        lambda index: minibatch_of(index, n_total, rl.minibatches, shuffle()), skip)
    plan = update_plan(samples, n_total, rl.minibatches, rl.micro_batch_size, rl.micro_batch_tokens,
                       roll.max_new_tokens, grpo.AGGREGATIONS[rl.loss_agg], shuffle(), w.sum, skip)
    old_logps, ref_logps = old_log_probs(s, samples, plan)
    clock.mark("old_logprobs")

    # 7. Policy update: ppo_epochs passes, one optimizer step per minibatch; gradients are
    #    accumulated over its micro-batches and summed over workers (the token weights are
    #    normalised over all workers' samples, so the sum is the minibatch's exact gradient).
    update = update_policy(s, samples, plan, old_logps, ref_logps)
    clock.mark("update")

    # 8. Drafter: the average of the drafters trained on idle workers is written into the one
    #    every engine runs; one worker (nothing to average) trains in a window here (opt-in).
    #    Then the new policy and drafter go into the rollout engine (our own engine runs the
    #    trainer's modules: nothing to copy; vLLM takes them in place and is checked).
    published()
    if s.drafter.trains and w.world == 1 and cfg.spot.single_worker == "window":
        drafter = s.drafter.train_in_window()
        clock.mark("spot")
    try:
        s.rollout.publish_policy(s.model)
        s.drafter.publish_to(s.rollout)
    except RolloutBackendError as e:
        raise TrainingError(f"after step {s.step + 1}: {e}; {_resume_hint(s)}") from None
    clock.mark("publish")

    # 9. Weight check: every engine runs the module its worker trained; compare what each
    #    will run next with worker 0's, so a stale or diverged copy stops the run.
    drafter_module = s.rollout.drafter
    checksums = (weights_checksum(s.model), weights_checksum(drafter_module) if drafter_module is not None else None)
    check_same_weights(w.gather(checksums), s.step)
    clock.mark("check")

    # 10. Metrics: every worker's share, gathered and merged (identically on every worker).
    mine = worker_share(clock, rollout, completions, rewards, correct, lengths, by_function, keep, advantages,
                        drafter, last_rollout_end, w.world, s.drafter.dropped, s.scorer.failures,
                        sample_log(s.tokenizer, batch, completions, rewards, lo)
                        if logs_samples(cfg.run.log_samples_every, s.step + 1) else [])
    row = merge_step_metrics(w.gather(mine), s.step + 1, update, checksums, s.drafter.trains)
    return {**row, "epoch": s.order.epochs_done(s.step + 1)}


def old_log_probs(s: RunState, samples: Samples, plan) -> tuple[dict, dict]:
    """log π_old of the micro-batches of every minibatch but the first (and log π_ref of all),
    without gradients. The first minibatch is on-policy: the update's own forward gives its
    log π_old (`update_policy`), so it costs no forward here (as TRL and verl skip the
    recomputation when the update is on-policy)."""
    temperature, dev = s.cfg.rollout.temperature, s.model.device
    ids = samples.ids
    old, ref = {}, {}
    with torch.no_grad(), autocast(dev, s.dtype):
        for i, micro in ((i, m) for i, minibatch in enumerate(plan) for m in minibatch):
            mb_ids = ids[micro.rows, : micro.width].to(dev)
            if i > 0:
                logits, _ = s.model(mb_ids)
                old[micro.key] = grpo.token_log_probs(logits[:, :-1], mb_ids[:, 1:], temperature)
            if s.ref_model is not None:
                ref[micro.key] = grpo.token_log_probs(s.ref_model(mb_ids)[0][:, :-1], mb_ids[:, 1:], temperature)
    return old, ref


def update_policy(s: RunState, samples: Samples, plan, old_logps: dict, ref_logps: dict) -> dict:
    """ppo_epochs passes over the minibatches of `plan`, one optimizer step each (PPO-clip with
    clip-higher, optional KL and entropy terms); returns the step's update statistics.
    Micro-batches without an entry in `old_logps` run before any optimizer step (the first
    minibatch), so their π_old is the forward's own log π, detached (the ratio is exactly 1);
    it is kept for later epochs."""
    rl, temperature, dev = s.cfg.rl, s.cfg.rollout.temperature, s.model.device
    loss_mask = samples.loss_mask  # a property over every sample: computed once, not per micro-batch
    policy = s.sharding.policy  # the engine's module, or its shards (run.shard=fsdp)
    policy.train()
    params_list = list(policy.parameters())
    losses, kls, entropies, clip_fracs, grad_norms = [], [], [], [], []
    extra_calls = s.sharding.extra_calls(plan)
    # Where the rollout backend keeps no hidden states (vLLM), the drafter learns from this
    # forward's: the target over every computed sequence, no extra forward (TLT §2.2).
    feeds_drafter = s.drafter.trains and not s.rollout.hidden_states
    for epoch in range(rl.ppo_epochs):
        for minibatch, extra in zip(plan, extra_calls):
            s.optimizer.zero_grad(set_to_none=True)
            totals = torch.zeros(5, device=dev)  # loss, kl, entropy, clipped weight, weight
            for micro in minibatch:
                mb_ids = samples.ids[micro.rows, : micro.width].to(dev)
                weights = micro.weights.to(dev)
                with autocast(dev, s.dtype):  # log-probs (grpo.token_log_probs) are float32 whatever the dtype
                    logits, hidden = policy(mb_ids)
                if feeds_drafter and epoch == 0:
                    s.drafter.add_sequences(s.step, mb_ids, samples.mask[micro.rows, : micro.width - 1], hidden)
                logp = grpo.token_log_probs(logits[:, :-1], mb_ids[:, 1:], temperature)
                mb_mask = loss_mask[micro.rows, : micro.width - 1]
                if micro.key not in old_logps:  # the on-policy first minibatch: π_old is this forward's π
                    old_logps[micro.key] = logp.detach()
                per_token, clipped = grpo.POLICY_LOSSES[rl.policy_loss](
                    logp, old_logps[micro.key], samples.advantages[micro.rows].to(dev),
                    mb_mask.to(dev), rl.clip_low, rl.clip_high)
                loss = (per_token * weights).sum()
                kl = entropy = torch.zeros((), device=dev)
                if s.ref_model is not None:
                    kl = (grpo.KL_ESTIMATORS[rl.kl_estimator](logp, ref_logps[micro.key]) * weights).sum()
                    loss = loss + rl.kl_coef * kl
                if rl.entropy_coef:
                    entropy = (grpo.token_entropy(logits[:, :-1], temperature) * weights).sum()
                    loss = loss - rl.entropy_coef * entropy
                (loss * s.sharding.loss_scale).backward()
                totals += torch.stack([loss.detach(), kl.detach(), entropy.detach(),
                                       (clipped * weights).sum().detach(), weights.sum()])
            totals[4] += minibatch.uncomputed_weight  # skipped tokens: loss 0, never clipped
            for _ in range(extra):  # sharded: match the other workers' forward+backward collectives
                (policy(torch.zeros(1, 2, dtype=torch.long, device=dev))[0].sum() * 0).backward()
            totals = s.sharding.reduce(params_list, totals)  # every worker now holds the same sums
            if totals[4] == 0 or not torch.isfinite(totals[0]):
                # No token of this minibatch counts on any worker, or its loss is not finite: no
                # update, the weights kept. The schedule counts the optimizer steps planned
                # (optim.py), so it moves on as if the step had been taken.
                s.bad_steps += bool(totals[4])
                with warnings.catch_warnings():  # torch warns of a scheduler step before any optimizer step
                    warnings.simplefilter("ignore", UserWarning)
                    s.scheduler.step()
                continue
            if not len(minibatch) and not extra:  # nothing computed here: a zero gradient still moves AdamW
                for p in params_list:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            norm = torch.nn.utils.clip_grad_norm_(params_list, rl.grad_clip)
            grad_norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
            s.optimizer.step()
            s.scheduler.step()
            losses.append(totals[0].item())
            kls.append(totals[1].item())
            entropies.append(totals[2].item())
            clip_fracs.append(totals[3].item() / totals[4].item())
    if losses:
        s.bad_steps = 0
    policy.eval()
    s.sharding.publish(s.model)
    mean = lambda xs: statistics.mean(xs) if xs else None  # noqa: E731
    return {"loss": mean(losses), "kl": mean(kls) if s.ref_model is not None else None,
            "entropy": mean(entropies) if rl.entropy_coef else None, "clip_frac": mean(clip_fracs) or 0.0,
            "grad_norm": mean(grad_norms), "lr": s.scheduler.get_last_lr()[0], "skipped_updates": s.bad_steps}


def check_same_weights(checksums: list[tuple], step: int) -> None:
    """Every worker's (policy, drafter) checksums equal worker 0's, or a TrainingError that
    names the worker and the part: its engine would roll out with different weights."""
    for rank, sums in enumerate(checksums[1:], start=1):
        for part, mine, reference in zip(("policy", "drafter"), sums, checksums[0]):
            if mine != reference:
                raise TrainingError(f"after step {step}, worker {rank}'s {part} weights (sha {mine}) differ from "
                                    f"worker 0's ({reference}): a stale or corrupted copy; the run stops here")


def evaluate_greedy(s: RunState) -> float | None:
    """Held-out greedy accuracy (None without held-out prompts): the mean of the first reward
    function over greedy responses; each worker evaluates a shard."""
    rows = s.eval_rows
    if not rows:
        return None
    lo, hi = s.workers.shard(len(rows))
    correct = 0.0
    if hi > lo:
        params = SamplingParams(temperature=0, max_new_tokens=s.cfg.rollout.max_new_tokens)
        try:
            completions, _ = s.rollout.generate([r["prompt_ids"] for r in rows[lo:hi]], params)
        except RolloutBackendError as e:
            raise TrainingError(f"evaluation after step {s.step}: {e}; {_resume_hint(s)}") from None
        except NonFiniteLogits as e:
            raise _diverged(s, f"the evaluation after step {s.step}", e) from None
        scored = s.scorer.score_calls(reward_items(rows[lo:hi], completions))
        correct = sum(parts[0][0] for parts in scored)  # the first reward function, unweighted
    s.workers.wait_for_all("eval")  # shards take unequal time: no collective timeout while waiting
    return s.workers.sum(torch.tensor(float(correct))).item() / len(rows)


def _checkpoint(s: RunState) -> None:
    """Worker 0 writes it: every worker holds the same weights (checked each step). A write
    that fails (full disk, read-only directory) stops the run; the last good one stays."""
    optimizer_state = s.sharding.optimizer_state(s.optimizer)  # a collective when sharded
    histories = s.workers.gather(s.draft_history.entries()) if s.draft_history is not None else None
    if s.workers.is_main:
        def extra(tmp: Path) -> None:
            s.drafter.save(tmp / "drafter")  # nothing without a trained drafter
            if histories is not None:
                save_histories(tmp / HISTORY_FILE, histories, s.draft_history.vocab_size)

        try:
            evaluated = s.history[-1].get("eval_accuracy") if s.history else None  # of these weights, if evaluated
            save_checkpoint(s.run_dir, s.step, s.model, s.tokenizer, optimizer_state, s.scheduler,
                            {"weights_sha": weights_checksum(s.model), "eval_accuracy": evaluated},
                            keep=s.cfg.run.keep_checkpoints, extra=extra)
        except OSError as e:
            raise WriteError(f"cannot write the checkpoint of step {s.step} into {s.run_dir / 'checkpoints'} "
                             f"({e.strerror or e})") from None
    s.saved_step = s.step  # on every worker, so that all of them agree on what is saved


def _diverged(s: RunState, where: str, error: Exception) -> Exception:
    """Non-finite logits: before any update, the model's own (`error` says so); after updates,
    the training diverged, and the newest checkpoints may hold the diverged weights."""
    if s.step == 0:
        return error
    said = (f"{where}: the policy's logits are not finite (NaN or inf) after {s.step} steps of updates: the "
            f"training diverged (rl.lr={s.cfg.rl.lr:g}); lower rl.lr")
    if s.saved_step is None:
        return TrainingError(f"{said}; no checkpoint was written yet")
    earlier = resumable_hint(s.run_dir / "checkpoints", f"step-{s.saved_step:06d}") or \
        "; none before it is kept (run.keep_checkpoints)"
    return TrainingError(f"{said} and resume from a checkpoint before the divergence: the newest, step "
                         f"{s.saved_step}, may hold the diverged weights{earlier}")


def _resume_hint(s: RunState) -> str:
    if s.saved_step is None:
        return "no checkpoint was written yet"
    return (f"the last checkpoint is step {s.saved_step} "
            f"(resume with `tailtamer train --resume {s.run_dir}`)")


def _save_before_stopping(s: RunState) -> str:
    """Checkpoint the state between two steps if it is newer than the last checkpoint; every
    worker calls it, and none goes on (to end its process) before worker 0 has written it."""
    if s.step > 0 and s.saved_step != s.step:
        _checkpoint(s)
        s.workers.barrier()
    return _resume_hint(s)


def train(cfg: TrainConfig, resume: Path | None = None, log=print, console=print,
          workers: Workers | None = None, claimed: bool = False, pace: NoPace = NoPace()) -> dict | None:
    """Run (or resume) `cfg` as this worker (one worker by default); `console=None` shows a
    progress bar with the step lines above it. Worker 0 claims the run directory (unless the
    launcher did: `claimed`), writes every file and returns the summary; the others return None.
    `pace`: what each step waits for (`bench train`'s arms take turns, tailtamer/pace.py)."""
    # A device this machine lacks, or an engine not installed, is an error here, before any file is written.
    w = workers or Workers(device=train_device(cfg.run.device, 0))
    if cfg.rollout.backend == "vllm":
        require_vllm()
    if not w.is_main:
        log = console = _silent
    lock = None
    if w.is_main and not claimed:
        cfg, lock = claim_run_dir(cfg, resume)
    try:
        check_startable(cfg, resume, w.world)
        if not claimed:  # else the launcher said it
            say_unread(cfg, log)
        cfg = w.share(lambda: prepare(cfg, log))
        return _train(cfg, resume, log, console, w, pace)
    finally:
        if lock is not None:
            lock.release(remove_if_unused=True)


def _train(cfg: TrainConfig, resume: Path | None, log, console, w: Workers, pace: NoPace) -> dict | None:
    changes = resume_changes(resume, to_dict(cfg)) if resume is not None and w.is_main else {}
    s = setup(cfg, resume, log, w)
    try:
        return _run_steps(s, cfg, resume, changes, log, console, w, pace)
    finally:
        s.rollout.close()  # after the last collective: vLLM takes the process group down with it


def _run_steps(s: RunState, cfg: TrainConfig, resume: Path | None, changes: dict, log, console, w: Workers,
               pace: NoPace) -> dict | None:
    if w.is_main:
        if resume is None:
            with writing("the run's config.yaml", s.run_dir, "; nothing was trained"):
                settings = run_settings(to_dict(s.cfg))
                atomic_write_text(s.run_dir / "config.yaml", yaml.safe_dump(settings, sort_keys=False))
        else:
            record_resume(s.run_dir, s.step, to_dict(cfg), changes, log)
        s.history = keep_metrics_through(s.run_dir / "metrics.jsonl", s.step, log)
        keep_metrics_through(s.run_dir / "samples.jsonl", s.step, log)
    if s.skipped_prompts:
        limit = prompt_limit(cfg, s.model.config.max_position_embeddings)
        log(f"skipped {s.skipped_prompts} prompts longer than {limit} tokens (data.max_prompt_tokens="
            f"{cfg.data.max_prompt_tokens}, or the model's context less one token)")
    # a failure before this process's first step keeps the run's summary.json (which may count
    # steps after the checkpoint that the resume drops from metrics.jsonl)
    t0, first_step = time.perf_counter(), s.step
    out, reported, completed, hurry = None, set(), False, False
    try:  # before the first step, outside the StopRequest: a stop ends the run at once, with nothing to save
        if pace.paced and s.step:  # its turns count from step 0
            raise ConfigError(f"a paced run starts at step 0 (this one resumes at step {s.step})")
        # the loggers first: one that cannot start stops the run before the evaluation's minutes
        out = RunLog(s.run_dir, cfg.run.loggers, to_dict(cfg), cfg.run.steps, s.step, console) if w.is_main else None
        evaluates = cfg.run.eval_every and s.eval_rows
        if s.step == 0 and evaluates:
            s.eval_at_start = evaluate_greedy(s)
    except BaseException:
        if out is not None:
            out.close()
        s.scorer.close()
        raise
    with StopRequest(log) as stop:
        try:
            w.barrier()  # start the first step together, so its timeline compares workers
            if w.is_main:
                pace.ready()
            while s.step < cfg.run.steps:
                pace.wait(s.step)
                try:
                    row = rl_step(s)
                except StepAborted as e:  # raised before the step changed any weights
                    raise TrainingError(f"{e}; {_save_before_stopping(s)}") from None
                s.step += 1
                if evaluates and (s.step % cfg.run.eval_every == 0 or s.step == cfg.run.steps):
                    row["eval_accuracy"] = evaluate_greedy(s)
                samples = row.pop("samples")
                s.history.append(row)
                if out is not None:
                    with writing(f"the metrics of step {s.step}", s.run_dir):
                        out.log(row, samples)
                    notice = s.rollout.notice
                    if notice and notice not in reported:
                        reported.add(notice)
                        log(notice)
                    for kind, entry in row["reward_failures"].items():
                        if kind not in reported:
                            reported.add(kind)
                            log(f"reward failure ({kind}) in step {s.step}: {entry['first']}; such samples score 0 "
                                f"and are counted (reward_errors / reward_timeouts); the run goes on")
                    s.drafter.checkpoint_async(s.run_dir / "drafter")  # the newest published one, in the background
                if s.bad_steps >= cfg.run.max_bad_steps > 0:
                    raise TrainingError(f"{s.bad_steps} non-finite losses in a row at step {s.step}; "
                                        f"{_save_before_stopping(s)}")
                if (cfg.run.save_every and s.step % cfg.run.save_every == 0) or s.step == cfg.run.steps:
                    _checkpoint(s)
                if w.any(stop.requested) and s.step < cfg.run.steps:
                    by = stop.reason or "a stop request (Ctrl-C or SIGTERM) to another worker"
                    raise Interrupted(f"stopped by {by} after step {s.step} of {cfg.run.steps}; "
                                      f"{_save_before_stopping(s)}", by)
                if w.is_main:  # a paced run's writes too (the drafter's, in the background) are done in its turn
                    pace.done(s.step - 1, settle=s.drafter.wait)
            pace.finish(cfg.run.steps)
            completed = True
        except WriteError as e:  # a full disk, say: the writes are atomic, so every earlier file is intact
            raise TrainingError(f"{e}; the run stops here; {_resume_hint(s)}") from None
        except KeyboardInterrupt:
            hurry = True  # a second Ctrl-C: no summary or plots either
            raise Interrupted(f"stopped at once by a second Ctrl-C in step {s.step + 1}; {_resume_hint(s)}") from None
        finally:
            if out is not None:
                out.close()
            try:
                s.drafter.wait()
            except WriteError as e:  # raised after the error being reported, if any: said, not raised
                log(str(e))
            s.scorer.close()
            # stopped or failed after a step: its steps so far (before one, the run's summary stands)
            if w.is_main and not completed and s.step > first_step and not hurry:
                try:
                    _summarize(s, w.world, time.perf_counter() - t0, finished=False)
                except (Exception, KeyboardInterrupt) as e:  # what stopped the run is the error to report
                    log(f"no summary or plots written in {s.run_dir} ({type(e).__name__}: {e})")
    if not w.is_main:
        return None
    with writing("summary.json and the plots", s.run_dir, f"; the run finished: its checkpoint of step "
                 f"{s.saved_step} and metrics.jsonl are complete"):  # nothing is left to resume
        return _summarize(s, w.world, time.perf_counter() - t0, finished=True)


def _summarize(s: RunState, world: int, seconds: float, finished: bool) -> dict:
    """Write summary.json and the plots of the run's steps so far (`finished`: it went through
    all of run.steps and its last checkpoint) and return the summary."""
    last = s.history[-1] if s.history else {}
    summary = run_summary(s.history, s.eval_at_start, seconds, run_dir=str(s.run_dir), workers=world,
                          finished=finished, skipped_prompts=s.skipped_prompts,
                          **{k: last.get(k, 0) for k in s.scorer.counts()},  # summed over workers
                          reward_failures=last.get("reward_failures", {}))
    atomic_write_json(s.run_dir / "summary.json", summary)
    if s.history:
        plot_rl_curves(s.history, s.run_dir / "curves.png", s.eval_at_start)
        plot_worker_timeline(s.history[-1], s.run_dir / "timeline.png")
        if s.drafter.frozen is not None or any(set(r.get("accepted_by_source") or {}) - {"eagle"} for r in s.history):
            plot_accept_lengths(s.history, s.run_dir / "drafter.png")
    return summary


def _silent(*_args) -> None:
    pass


def run_worker(cfg: TrainConfig, resume: Path | None, console, claimed: bool = False,
               pace: NoPace = NoPace()) -> dict | None:
    """One worker of a multi-process run (spawned locally or started by torchrun)."""
    device = train_device(cfg.run.device, torchrun_env(os.environ)[2])
    workers = Workers.from_env(cfg.run.dist_timeout_s, device)
    summary = train(cfg, resume, console=console, workers=workers, claimed=claimed, pace=pace)
    workers.close()  # not after an error: the launcher stops every worker then
    return summary


def launch(cfg: TrainConfig, resume: Path | None = None, console=print, pace: NoPace = NoPace()) -> dict | None:
    """`tailtamer train`: this process as one worker of a torchrun job, or `run.workers` local
    worker processes (one per core by default), or, with one worker, this process alone."""
    if "WORLD_SIZE" in os.environ:
        return run_worker(cfg, resume, console, pace=pace)
    device = resolve_device(cfg.run.device, "run.device")
    if cfg.rollout.backend == "vllm":
        require_vllm()
    gpus = gpu_count() if device.type == "cuda" else 0
    world = resolve_workers(cfg.run.workers, cfg.rollout.prompts_per_step, gpus)
    if cfg.run.workers > world:  # asked for: say why fewer run
        print(f"run.workers={cfg.run.workers}: {world} worker{'s' * (world > 1)}, as a step has only "
              f"{cfg.rollout.prompts_per_step} prompt{'s' * (cfg.rollout.prompts_per_step != 1)} to share "
              f"(rollout.prompts_per_step)")
    if world == 1:
        return train(cfg, resume, console=console, pace=pace)
    # The launcher claims the run directory (and holds its lock while the workers run) and
    # resolves the built-ins here, not in worker 0: a spawned worker gets only its share of
    # the cores, and a first run's base-model SFT and drafter warm-up would take ~1.6x as long.
    cfg, lock = claim_run_dir(cfg, resume)
    try:
        check_startable(cfg, resume, world)
        say_unread(cfg, print)
        cfg = prepare(cfg)
        if cfg.run.workers == 0:  # automatic: no more workers than a step has prompts to shard
            prompts = training_prompts(cfg)
            if prompts < world:
                world = max(1, prompts)
                print(f"run.workers=0: {world} worker{'s' * (world > 1)} rather than one per "
                      f"{'GPU' if gpus else 'core'}, as a step has only {prompts} prompt{'s' * (prompts != 1)} to "
                      f"share (rollout.prompts_per_step={cfg.rollout.prompts_per_step}, data.train={cfg.data.train})")
        if world == 1:
            return train(cfg, resume, console=console, claimed=True, pace=pace)
        return spawn(world, run_worker, (cfg, resume, console, True, pace), partial(resume_note, run_dir_of(cfg, resume)))
    finally:
        lock.release(remove_if_unused=True)
