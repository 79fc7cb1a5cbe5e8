"""`tailtamer bench profile`: where the time of a decode step and of an RL step goes.

Decode: for batch sizes 1, 4 and 16, a plain step and SD steps (a depth-4 chain, eager and with
its draft levels compiled, a tree, and a chain fused with suffix drafts) of the built-in base
model with its warm-up drafter, split by the engine's phase marks (rollout/stats.py `PHASES`):
target forward, drafter extend, each draft level, the suffix index's update and drafts,
verify, sampling, the acceptance rule, the commit, and host-side bookkeeping; per step, in
ms; the suffix index's cost per token it indexed and per token it drafted, in µs.
RL: a few steps of the default job with SD on, split by the step's own clock (rollout with
its tail, rewards, old log-probs, update, and what the drafter adds: publish, the weight
check and the spot trainer's preemption latency). Update: the policy update's tokens per
second against plain forward+backward passes over the same tokens.
"""

from __future__ import annotations

import statistics
import time

import torch

from tailtamer.model.drafter import load_drafter
from tailtamer.model.io import load_pretrained
from tailtamer.rollout.eagle import EagleProposer
from tailtamer.rollout.fused import FusedProposer
from tailtamer.rollout.engine import Engine, EngineConfig
from tailtamer.rollout.sampling import SamplingParams
from tailtamer.rollout.speculator import Speculator
from tailtamer.rollout.stats import PHASES
from tailtamer.rollout.suffix import SuffixProposer

# arm -> (strategy, draft chain compiled): None is plain decoding
ARMS = {"plain": None, "4_1_5": ("4_1_5", False), "4_1_5 compiled": ("4_1_5", True), "4_2_8": ("4_2_8", False),
        "4_1_5+s8": ("4_1_5+s8", False)}


def _speculator(drafter, strategy: str, compiled: bool) -> Speculator:
    eagle = EagleProposer(drafter, compiled=compiled)
    fused = "+s" in strategy
    return Speculator.fixed(FusedProposer(eagle, SuffixProposer()) if fused else eagle, strategy)


def profile_decode(model_dir, drafter_dir, batches=(1, 4, 16), new_tokens: int = 96, repeats: int = 3) -> list[dict]:
    """Per batch size and arm: ms per step by phase (medians over `repeats` interleaved runs),
    tokens per step, and the step's cost relative to a plain step at that batch size."""
    from tailtamer.bench import worked_prompts

    model, tokenizer = load_pretrained(model_dir)
    drafter = load_drafter(drafter_dir, model)
    # long worked responses, twice as many as the batch holds: most steps run at full batch
    prompts = worked_prompts(tokenizer, 2 * max(batches), seed=7, min_ops=10)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=5)
    rows = []
    for batch in batches:
        engines = {arm: Engine(model, tokenizer, EngineConfig(max_batch_size=batch), speculator=None if spec is None
                               else _speculator(drafter, *spec)) for arm, spec in ARMS.items()}
        runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        mine = prompts[: 2 * batch]
        setup_s = {arm: engine.generate(mine[:batch], params)[1].setup_s  # warm-up (and compiling)
                   for arm, engine in engines.items()}
        for _ in range(repeats):
            for arm, engine in engines.items():
                suffix = getattr(engine.proposer, "suffix", None)
                counted = dict(suffix.counts) if suffix is not None else None
                PHASES.start()
                _, stats = engine.generate(mine, params)
                phases = PHASES.stop()
                steps = stats.decode_steps
                index_us = {}
                if suffix is not None:  # the index's cost per token indexed and per token drafted
                    for what, phase in (("indexed", "sd: suffix index update"), ("drafted", "sd: suffix drafts")):
                        n = suffix.counts[what] - counted[what]
                        index_us[what] = 1e6 * phases.get(phase, (0.0, 0))[0] / n if n else None
                runs[arm].append({"step_ms": 1e3 * (stats.plain_seconds + stats.sd_seconds) / steps,
                                  "tokens_per_step": (stats.tokens - len(mine)) / steps,
                                  "phases": {k: 1e3 * v / steps for k, (v, _) in phases.items()},
                                  "accept_len": stats.accept_len_mean, "index_us": index_us})
        plain_ms = statistics.median(r["step_ms"] for r in runs["plain"])
        for arm, results in runs.items():
            names = sorted({k for r in results for k in r["phases"]})
            step_ms = statistics.median(r["step_ms"] for r in results)
            rows.append({
                "batch": batch, "arm": arm, "step_ms": round(step_ms, 3),
                "step_vs_plain": round(step_ms / plain_ms, 3),
                "tokens_per_step": round(statistics.median(r["tokens_per_step"] for r in results), 3),
                "accept_len": round(statistics.median(r["accept_len"] for r in results), 3),
                "compile_s": round(setup_s[arm], 1),
                # says whether the chains compiled (a failure runs them eager, timed as eager)
                "notice": engines[arm].proposer.notice if engines[arm].proposer is not None else None,
                "phases_ms": {k: round(statistics.median(r["phases"].get(k, 0.0) for r in results), 3) for k in names},
                **({f"suffix_us_per_{k}_token": round(statistics.median(r["index_us"][k] for r in results), 2)
                    for k in ("indexed", "drafted") if all(r["index_us"].get(k) for r in results)}),
            })
    return rows


RUNS = "runs/bench-profile"  # where its RL run goes (profile), replaced by its next run


def profile_rl(steps: int = 6, overrides: tuple[str, ...] = (), out_dir: str = RUNS) -> dict:
    """Medians over the steps (the first excluded) of each phase of the RL step, as worker 0
    and the slowest worker saw it, with the rollout's tail."""
    import json
    import shutil
    from pathlib import Path

    from tailtamer.bench import _quiet
    from tailtamer.bench_train import check_replaceable
    from tailtamer.config import load_train_config
    from tailtamer.rl.trainer import launch

    cfg = load_train_config(None, [f"run.steps={steps}", "run.name=profile", f"run.out_dir={out_dir}",
                                   "run.eval_every=0", "run.save_every=0", *overrides])
    check_replaceable(Path(out_dir) / "profile", "bench profile")  # its own earlier run only
    shutil.rmtree(Path(out_dir) / "profile", ignore_errors=True)
    launch(cfg, console=_quiet)
    rows = [json.loads(line) for line in (Path(out_dir) / "profile" / "metrics.jsonl").read_text().splitlines()][1:]
    phases: dict[str, list[float]] = {}
    for row in rows:
        per_worker: dict[tuple[int, str], float] = {}
        for worker, name, a, b in row["timeline"]:
            per_worker[(worker, name)] = per_worker.get((worker, name), 0.0) + b - a
        for name in {n for _, n in per_worker}:
            phases.setdefault(name, []).append(max(v for (w, n), v in per_worker.items() if n == name))
    med = lambda key: round(statistics.median(r[key] for r in rows), 3)  # noqa: E731
    return {
        "steps": len(rows), "workers": rows[0]["workers"], "overrides": list(overrides),
        "step_s": med("step_s"), "rollout_s": med("rollout_s"), "rollout_tail_s": med("rollout_tail_s"),
        "train_s": med("train_s"), "sd_tokens_frac": med("sd_tokens_frac"),
        "phase_s_slowest_worker": {k: round(statistics.median(v), 3) for k, v in sorted(phases.items())},
    }


def profile_update(model_dir, repeats: int = 3) -> dict:
    """The policy update's throughput against the CPU's: one default step's samples (16 prompts
    x 8 at T=1 from the base model, one worker, rewarded and their GRPO advantages computed),
    timed five ways, in real (prompt + response) tokens per second: the old log-probs and the
    update as `rl_step` runs them (`old_log_probs`: no-grad forwards for every minibatch but
    the on-policy first; `update_policy`: micro-batch forwards, loss, backward, AdamW; samples
    of advantage 0 in no micro-batch), the same with every sample computed
    (`rl.skip_zero_advantage=false`), those micro-batches' forward+backward alone, one forward+
    backward of every sample padded to the longest in a single batch, and one forward+
    backward of as many tokens in dense rows (what this CPU does for that many tokens)."""
    from types import SimpleNamespace

    from tailtamer.config import TrainConfig
    from tailtamer.dist import Workers
    from tailtamer.drafter.adaptive import NoDrafter
    from tailtamer.rl import grpo
    from tailtamer.rl.batching import Samples, needed_width, response_batch, update_plan
    from tailtamer.rl.optim import make_optimizer
    from tailtamer.rl.sharding import Replicated
    from tailtamer.rl.trainer import old_log_probs, update_policy
    from tailtamer.tasks.arithmetic import ArithmeticTask, reward

    cfg = TrainConfig()
    roll, rl = cfg.rollout, cfg.rl
    model, tokenizer = load_pretrained(model_dir)
    problems = ArithmeticTask().dataset(roll.prompts_per_step, seed=3)
    batch = [{"prompt_ids": tokenizer.encode(p["prompt"])} for p in problems]
    params = SamplingParams(temperature=roll.temperature, max_new_tokens=roll.max_new_tokens,
                            n=roll.group_size, seed=11)
    completions, _ = Engine(model, tokenizer).generate([b["prompt_ids"] for b in batch], params)
    ids, mask = response_batch(batch, completions, tokenizer.pad_token_id or 0)
    n = len(completions)
    rewards = torch.tensor([reward(c.text, problems[c.prompt_index]["answer"]) for c in completions])
    advantages = grpo.ADVANTAGES[rl.advantage](rewards.view(-1, roll.group_size)).flatten()
    samples = Samples(ids, mask, torch.ones(n, dtype=torch.bool), advantages, torch.arange(n))
    plans = {skip: update_plan(samples, n, rl.minibatches, rl.micro_batch_size, rl.micro_batch_tokens,
                               roll.max_new_tokens, grpo.AGGREGATIONS[rl.loss_agg], torch.Generator().manual_seed(0),
                               skip_zero_advantage=skip) for skip in (False, True)}
    plan = plans[False]
    tokens = int(needed_width(mask).sum())
    workers = Workers()
    sharding = Replicated(workers)
    optimizer, scheduler = make_optimizer(sharding.wrap(model), rl, cfg.run.steps)
    # our engine (its rollout kept the hidden states), no drafter trained
    state = SimpleNamespace(cfg=cfg, workers=workers, model=model, optimizer=optimizer, scheduler=scheduler,
                            sharding=sharding, ref_model=None, drafter=NoDrafter(), bad_steps=0, step=0,
                            dtype=torch.float32, rollout=SimpleNamespace(hidden_states=True))

    def fwd_bwd(batches):
        for batch_ids in batches:
            logits, _ = model(batch_ids)
            logits.logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    micro = [ids[m.rows, : m.width] for minibatch in plan for m in minibatch]
    dense = torch.randint(0, model.config.vocab_size, (tokens // 64, 64))
    def update(skip: bool):
        return update_policy(state, samples, plans[skip], old_log_probs(state, samples, plans[skip])[0], {})

    arms = {"old log-probs + update (as rl_step runs them: samples of advantage 0 skipped)": lambda: update(True),
            "the same, every sample computed (rl.skip_zero_advantage=false)": lambda: update(False),
            "its micro-batches, forward+backward only": lambda: fwd_bwd(micro),
            "one padded batch, forward+backward": lambda: fwd_bwd([ids]),
            "as many tokens in dense 64-token rows, forward+backward": lambda: fwd_bwd([dense])}
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(repeats):
        for name, run in arms.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    model.eval()
    zero = advantages == 0
    return {"samples": n, "tokens": tokens, "padded_width": ids.shape[1],
            "zero_advantage_samples": int(zero.sum()), "zero_advantage_tokens": int(needed_width(mask[zero]).sum()),
            "micro_batch_padded_tokens": sum(x.numel() for x in micro),
            "micro_batches": len(micro), "optimizer_steps": rl.minibatches,
            "tokens_per_s": {k: round(tokens / statistics.median(v)) for k, v in times.items()},
            "seconds": {k: round(statistics.median(v), 3) for k, v in times.items()}}


def bench_profile(model_dir: str | None = None, rl_steps: int = 6, repeats: int = 3, drafter_dir: str | None = None) -> dict:
    from tailtamer.bench import _default_model_dir, progress
    from tailtamer.drafter.train import ensure_builtin_drafter

    path = _default_model_dir(model_dir)
    t0 = time.perf_counter()
    report = {"model": str(path), "threads": torch.get_num_threads(),
              "decode": profile_decode(path, drafter_dir or ensure_builtin_drafter(path, log=progress),
                                       repeats=repeats),
              "update": profile_update(path, repeats=repeats)}
    if rl_steps and model_dir is None:
        report["rl_step"] = profile_rl(rl_steps)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report
