"""TRL's GRPOTrainer alone, with TLTRollout (SD off, and adaptive), and tailtamer's own trainer
(SD off, and on), interleaved in one run.

Arms: `trl` (TRL's own transformers generation), `trl_tlt_off` (TRL with `TLTRollout(spec="off")`:
tailtamer's engine, plain decoding), `trl_tlt` (TRL with `TLTRollout(spec="adaptive")` and the
built-in base model's warm-up EAGLE drafter, one process: the drafter stays frozen),
`tailtamer` (tailtamer's trainer, SD off) and `tailtamer_sd` (its default: adaptive SD, the
drafter trained on idle workers). TRL's step is split into its generation (TLTRollout's
`tlt/rollout_s`, or TRL's profiled `transformers.generate`) and the rest.

Every arm gets the same things: the base model (the built-in base model from `tailtamer sft`)
in float32 with no autocast (TRL's GRPOConfig defaults to bf16 autocast, which this CPU
emulates slowly) and no activation checkpointing (TRL's default is on); the same prompts at
every step (tailtamer's draw, fed to TRL unshuffled); the same group size, response length
limit, temperature, learning rate (constant, no warm-up), clip bounds, loss (token-mean = TRL's
"dapo"), one optimizer step per rollout and no KL. Repetitions alternate the two trainers;
step times are medians over every step but each run's first (one-off allocations).

    pip install -e ".[trl]"    # TRL, as `make test` installs it
    python benchmarks/grpo_vs_trl.py --steps 8 --repeats 2 --out runs/bench-trl.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path


def run_tailtamer(model_dir: Path, problems: list[dict], args, out_dir: Path, drafter: Path | None = None) -> list[dict]:
    from tailtamer.config import load_train_config
    from tailtamer.rl.trainer import train

    data = out_dir / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p["prompt"], "answer": p["answer"]}) + "\n" for p in problems))
    cfg = load_train_config(None, [
        f"run.model={model_dir}", f"data.train={data}", f"run.out_dir={out_dir}", "run.name=tailtamer",
        f"run.steps={args.steps}", "run.eval_every=0", "run.save_every=0", f"run.seed={args.seed}",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.temperature=1.0",
        f"rl.lr={args.lr}", "rl.warmup=0", "rl.minibatches=1", "rl.clip_low=0.2", "rl.clip_high=0.28",
        "rl.loss_agg=token-mean", "rl.advantage=grpo", *([f"spec.drafter={drafter}"] if drafter else ["spec.mode=off"])])
    train(cfg, log=lambda _: None, console=lambda _: None)
    rows = [json.loads(x) for x in (out_dir / "tailtamer" / "metrics.jsonl").read_text().splitlines()]
    return [{"step_s": r["step_s"], "reward": r["reward_mean"], "response_len_mean": r["response_len_mean"],
             "generate_s": r["rollout_s"]} for r in rows]


def run_trl(model_dir: Path, step_batches: list[list[dict]], args, out_dir: Path, rollout=None) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"error: this benchmark needs TRL ({e}); run `pip install -e '.[trl]'`") from None

    from tailtamer.tasks.arithmetic import reward

    seen_prompts = []

    def correct(completions, answer, prompts, **_):  # the task's own scorer, as tailtamer's arm uses
        seen_prompts.append(sorted(set(prompts)))
        return [reward(text, truth) for text, truth in zip(completions, answer)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.rows, self.t = [], None

        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.rows.append({"step_s": time.perf_counter() - self.t, "generate_s": sum(generated)})
            generated.clear()

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "reward" in logs and self.rows:
                self.rows[-1]["reward"] = logs["reward"]
                self.rows[-1]["response_len_mean"] = logs.get("completions/mean_length")

    torch.manual_seed(args.seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # tailtamer's prompts of step s are rows s*P .. (s+1)*P - 1, served in order.
    dataset = Dataset.from_list([{"prompt": p["prompt"], "answer": p["answer"]} for batch in step_batches for p in batch])
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    no_checkpointing = {k: False for k in ("gradient_checkpointing", "activation_checkpointing") if k in names}
    config = GRPOConfig(
        output_dir=str(out_dir / "trl"), max_steps=args.steps, learning_rate=args.lr, warmup_steps=0,
        lr_scheduler_type="constant", per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, max_completion_length=args.max_new_tokens, temperature=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", num_iterations=1,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=args.seed,
        adam_beta2=0.99, max_grad_norm=1.0, dataloader_num_workers=0, bf16=False, fp16=False,
        shuffle_dataset=False, **no_checkpointing)
    times = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[times], rollout_func=rollout)
    generated, real = [], trainer._generate

    def timed(*a, **k):  # the step's generation: TRL's transformers generate, or the rollout_func
        t = time.perf_counter()
        out = real(*a, **k)
        generated.append(time.perf_counter() - t)
        return out
    trainer._generate = timed
    trainer.train()
    expected = [sorted({p["prompt"] for p in batch}) for batch in step_batches]
    for row, got, want in zip(times.rows, seen_prompts, expected):
        row["same_prompts_as_tailtamer"] = got == want
    return times.rows


def median(runs: list[list[dict]], key: str):
    values = [r[key] for rows in runs for r in rows[1:] if r.get(key) is not None]
    return statistics.median(values) if values else None


def mean_over(runs: list[list[dict]], key: str, lo: int, hi: int):
    values = [r[key] for rows in runs for r in rows[lo:hi] if r.get(key) is not None]
    return round(statistics.mean(values), 4) if values else None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each trainer, alternating")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--arms", nargs="+", default=["trl", "trl_tlt_off", "trl_tlt", "tailtamer", "tailtamer_sd"],
                        help="which arms to run (default: all five)")
    args = parser.parse_args(argv)

    from tailtamer.rl.data import PromptOrder
    from tailtamer.sft import SFTConfig, ensure_base_model
    from tailtamer.tasks.arithmetic import ArithmeticTask

    from tailtamer.drafter.train import ensure_builtin_drafter
    from tailtamer.integrations.trl import TLTRollout

    model_dir = ensure_base_model(SFTConfig())
    drafter = ensure_builtin_drafter(model_dir)
    problems = ArithmeticTask().dataset(args.steps * args.prompts * 4, seed=args.seed + 17)
    order = PromptOrder(len(problems), args.prompts, args.seed)
    step_batches = [[problems[i] for i in order.indices(s)] for s in range(args.steps)]
    arms = {
        "trl": lambda out: run_trl(model_dir, step_batches, args, out),
        "trl_tlt_off": lambda out: run_trl(model_dir, step_batches, args, out, TLTRollout(spec="off", drafter=None)),
        "trl_tlt": lambda out: run_trl(model_dir, step_batches, args, out, TLTRollout(spec="adaptive", drafter=str(drafter))),
        "tailtamer": lambda out: run_tailtamer(model_dir, problems, args, out),
        "tailtamer_sd": lambda out: run_tailtamer(model_dir, problems, args, out, drafter),
    }
    names = [n for n in arms if n in args.arms]
    runs: dict[str, list[list[dict]]] = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:  # the order rotates from run to run
            with tempfile.TemporaryDirectory() as tmp:
                runs[name].append(arms[name](Path(tmp)))
    quarter = max(1, args.steps // 3)
    report = {"setup": vars(args) | {"model": str(model_dir)}}
    for name, rows in runs.items():
        generate = median(rows, "generate_s")
        report[name] = {
            "step_s_median": round(median(rows, "step_s"), 3),
            "generate_s_median": round(generate, 3) if generate is not None else None,
            "reward_first_steps": mean_over(rows, "reward", 0, quarter),
            "reward_last_steps": mean_over(rows, "reward", args.steps - quarter, args.steps),
            "response_len_first_steps": mean_over(rows, "response_len_mean", 0, quarter),
            "response_len_last_steps": mean_over(rows, "response_len_mean", args.steps - quarter, args.steps),
            "steps": rows,
        }
    step = {name: report[name]["step_s_median"] for name in runs}
    report["ratios"] = {f"{a}_step_over_{b}": round(step[a] / step[b], 3) for a, b in (
        ("trl", "tailtamer"), ("trl", "trl_tlt_off"), ("trl", "trl_tlt"), ("trl_tlt", "tailtamer_sd"),
        ("tailtamer", "tailtamer_sd")) if a in step and b in step}
    report["trl_saw_the_same_prompts"] = all(r["same_prompts_as_tailtamer"] for name in runs if name.startswith("trl")
                                             for rows in runs[name] for r in rows)
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "steps"} if isinstance(v, dict) else v)
                      for k, v in report.items()}, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
