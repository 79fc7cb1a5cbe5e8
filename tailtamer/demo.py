"""`tailtamer demo`: one long-tail rollout of the built-in base model, and where its time goes.

It trains (or reuses) the base model, samples n responses for held-out problems at
temperature 1, and reports accuracy (by problem length, and for responses that answer
directly against those that work the problem out), the response-length distribution, and how
much of the rollout's time is spent with only a few requests still running: the tail TLT attacks.
"""

from __future__ import annotations

import json
from pathlib import Path

from tailtamer.atomic import atomic_write_json, atomic_write_text
from tailtamer.model.io import load_pretrained
from tailtamer.rollout.engine import Engine, EngineConfig
from tailtamer.rollout.stats import RolloutStats
from tailtamer.rollout.sampling import SamplingParams
from tailtamer.sft import SFTConfig, ensure_base_model
from tailtamer.tasks.arithmetic import HELD_OUT_SEED, ArithmeticTask, length_stats, reward



def tail_share(stats: RolloutStats, batch: int, fraction: float = 0.25) -> dict:
    """Share of decode time (and steps) with at most `fraction` of the batch still running."""
    ends = [t for t, _, _ in stats.timeline]
    durations = [t1 - t0 for t0, t1 in zip([0.0] + ends[:-1], ends)]
    limit = max(1, int(batch * fraction))
    in_tail = [n <= limit for _, n, _ in stats.timeline]
    total = sum(durations) or 1.0
    return {"running_at_most": limit,
            "time_share": sum(d for d, tail in zip(durations, in_tail) if tail) / total,
            "step_share": sum(in_tail) / max(1, len(in_tail))}


DEMO_MAX_NEW_TOKENS = 512  # a response's length limit in the demo rollout


def evaluate(model_dir: Path, n_prompts: int, n: int, seed: int, temperature: float = 1.0,
             max_new_tokens: int = DEMO_MAX_NEW_TOKENS, max_batch_size: int = 512):
    task = ArithmeticTask()
    problems = task.dataset(n_prompts, HELD_OUT_SEED + seed)
    model, tokenizer = load_pretrained(model_dir)
    engine = Engine(model, tokenizer, EngineConfig(max_batch_size=max_batch_size))
    params = SamplingParams(temperature=temperature, n=n, max_new_tokens=max_new_tokens, seed=seed)
    completions, stats = engine.generate([tokenizer.encode(p["prompt"]) for p in problems], params)
    rewards = [reward(c.text, problems[c.prompt_index]["answer"]) for c in completions]
    return problems, completions, rewards, stats


OPS_BUCKETS = ((1, 1), (2, 3), (4, 7), (8, None))


def accuracy_breakdown(problems: list[dict], completions, rewards: list[float]) -> dict:
    """Accuracy by the problem's number of operations, and for responses that state the
    answer at once (`answer: N` first) against those that work it out: {name: [accuracy, n]}."""
    groups: dict[str, list[float]] = {}
    for c, r in zip(completions, rewards):
        ops = ArithmeticTask.num_ops(problems[c.prompt_index]["prompt"])
        lo, hi = next((lo, hi) for lo, hi in OPS_BUCKETS if ops >= lo and (hi is None or ops <= hi))
        name = f"ops {lo}" if lo == hi else f"ops {lo}+" if hi is None else f"ops {lo}-{hi}"
        for key in (name, "direct answer" if c.text.startswith("answer:") else "worked"):
            groups.setdefault(key, []).append(r)
    return {k: [sum(v) / len(v), len(v)] for k, v in sorted(groups.items())}


OUTPUT_FILES = ("completions.jsonl", "report.json", "timeline.json")


def run_demo(out_dir: Path, n_prompts: int = 64, n: int = 8, seed: int = 0, model: Path | None = None) -> dict:
    model_dir = model or ensure_base_model(SFTConfig())
    problems, completions, rewards, stats = evaluate(model_dir, n_prompts, n, seed)
    lengths = [len(c.token_ids) for c in completions]
    report = {
        "model": str(model_dir),
        "samples": len(completions),
        "accuracy": sum(rewards) / len(rewards),
        "accuracy_by": accuracy_breakdown(problems, completions, rewards),
        "response_length": length_stats(lengths),
        "reference_length": length_stats([len(p["trace"]) + 1 for p in problems]),
        "tail": tail_share(stats, min(len(completions), 512)),
        **{k: v for k, v in stats.summary().items() if k != "timeline"},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "completions.jsonl", "".join(
        json.dumps({"prompt_index": c.prompt_index, "sample_index": c.sample_index, "text": c.text,
                    "reward": r, "finish_reason": c.finish_reason}) + "\n" for c, r in zip(completions, rewards)))
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_json(out_dir / "timeline.json", stats.summary()["timeline"])
    L, tail = report["response_length"], report["tail"]
    print(f"base model: {model_dir}")
    print(f"{len(completions)} samples ({n_prompts} prompts x {n}), temperature 1: accuracy {report['accuracy']:.1%}")
    print("accuracy by " + ", ".join(f"{k}: {a:.1%} of {m}" for k, (a, m) in report["accuracy_by"].items()))
    print(f"response length p50 {L['p50']:.0f}  p90 {L['p90']:.0f}  max {L['max']:.0f}  "
          f"(max/p50 = {L['max_over_p50']:.1f})")
    print(f"rollout {stats.seconds:.1f}s, {report['tokens_per_s']:.0f} tokens/s; "
          f"{tail['time_share']:.0%} of decode time ran with <= {tail['running_at_most']} requests left")
    print(f"wrote {out_dir}/{', '.join(OUTPUT_FILES)}")
    return report
