"""tailtamer GRPO (plain decoding) beside TRL's GRPOTrainer, in one run.

Same base model (the built-in tiny model from `tailtamer sft`), same prompts (the built-in
arithmetic task), same group size, response length limit, temperature, learning rate, clip
bounds, loss (token-mean = TRL's "dapo"), one optimizer step per rollout and no KL. Prints per-
step time and reward of both and the ratio of their median step times.

    pip install trl            # only this benchmark needs it
    python benchmarks/grpo_vs_trl.py --steps 8 --out runs/bench-trl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def run_tailtamer(model_dir: Path, problems: list[dict], args, out_dir: Path) -> list[dict]:
    from tailtamer.config import load_train_config
    from tailtamer.rl.trainer import train

    data = out_dir / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p["prompt"], "answer": p["answer"]}) + "\n" for p in problems))
    cfg = load_train_config(None, [
        f"run.model={model_dir}", f"data.train={data}", f"run.out_dir={out_dir}", "run.name=tailtamer",
        f"run.steps={args.steps}", "run.eval_every=0", "run.save_every=0", f"run.seed={args.seed}",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.temperature=1.0",
        f"rl.lr={args.lr}", "rl.warmup=1", "rl.minibatches=1", "rl.clip_low=0.2", "rl.clip_high=0.28",
        "rl.loss_agg=token-mean", "rl.advantage=grpo", "spec.mode=off"])
    train(cfg, log=lambda _: None, console=lambda _: None)
    rows = [json.loads(x) for x in (out_dir / "tailtamer" / "metrics.jsonl").read_text().splitlines()]
    return [{"step_s": r["step_s"], "reward": r["reward_mean"], "response_len_mean": r["response_len_mean"]}
            for r in rows]


def run_trl(model_dir: Path, problems: list[dict], args, out_dir: Path) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"error: this benchmark needs TRL ({e}); run `pip install trl`") from None

    from tailtamer.tasks.arithmetic import ANSWER_RE

    def correct(completions, answer, **_):
        out = []
        for text, truth in zip(completions, answer):
            m = ANSWER_RE.search(text)
            out.append(float(m is not None and m.group(1) == truth))
        return out

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.rows, self.t = [], None

        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.rows.append({"step_s": time.perf_counter() - self.t})

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "reward" in logs and self.rows:
                self.rows[-1]["reward"] = logs["reward"]
                self.rows[-1]["response_len_mean"] = logs.get("completions/mean_length")

    torch.manual_seed(args.seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": p["prompt"], "answer": p["answer"]} for p in problems])
    config = GRPOConfig(
        output_dir=str(out_dir / "trl"), max_steps=args.steps, learning_rate=args.lr, warmup_steps=1,
        lr_scheduler_type="constant_with_warmup", per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, max_completion_length=args.max_new_tokens, temperature=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", num_iterations=1,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=args.seed,
        adam_beta2=0.99, max_grad_norm=1.0, dataloader_num_workers=0)
    times = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[times])
    trainer.train()
    return times.rows


def median(rows, key):
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the JSON report here")
    args = parser.parse_args(argv)

    from tailtamer.sft import SFTConfig, ensure_base_model
    from tailtamer.tasks.arithmetic import ArithmeticTask

    model_dir = ensure_base_model(SFTConfig())
    problems = ArithmeticTask().dataset(args.steps * args.prompts * 4, seed=args.seed + 17)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        trl_rows = run_trl(model_dir, problems, args, tmp)
        ours = run_tailtamer(model_dir, problems, args, tmp)
    # The first step of each pays one-off costs (allocations, lazy imports): medians skip it.
    report = {
        "setup": vars(args) | {"model": str(model_dir)},
        "tailtamer": {"steps": ours, "step_s_median": median(ours[1:], "step_s"),
                      "reward_mean": statistics.mean(r["reward"] for r in ours)},
        "trl": {"steps": trl_rows, "step_s_median": median(trl_rows[1:], "step_s"),
                "reward_mean": statistics.mean(r["reward"] for r in trl_rows if "reward" in r)},
    }
    report["trl_step_s_over_tailtamer"] = report["trl"]["step_s_median"] / report["tailtamer"]["step_s_median"]
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
