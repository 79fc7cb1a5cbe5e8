"""`tailtamer` command line: train, generate, sft, drafter, init-model, task, demo, bench.

Bad input ends with a one-line `error: ...` naming the file, field or row, and exit code 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

from tailtamer.arguments import at_least_one, check_responses_fit, nonempty, preset, seed
from tailtamer.atomic import remove_empty_dirs
from tailtamer.errors import DataError, TailtamerError
from tailtamer.generate import cmd_generate
from tailtamer.outputs import CREATED, fresh_output_dir, output_file
from tailtamer.rollout.speculator import GPU_BS_THRESHOLD, SpecConfig
from tailtamer.rollout.vllm_backend import VLLMConfig
from tailtamer.stopping import CLOSED_PIPE, Interrupted, Terminated, sigterm_stops_at_once, stdout_closed

# Which benchmarks each `bench` flag is for
BENCH_FLAGS = {"--model": ("decode", "sd", "rollout", "profile"), "--preset": ("decode",),
               "--drafter": ("sd", "rollout", "profile"), "--steps": ("train", "profile"), "--new-tokens": ("decode",),
               "--set": ("train",), "--group": ("sd",), "--arms": ("rollout",)}
def cmd_train(args) -> None:
    from tailtamer.config import config_help, config_reference, load_train_config
    from tailtamer.outputs import run_holding
    from tailtamer.rl.run_dir import kept_logs
    from tailtamer.rl.trainer import launch

    if args.help_config is not None:  # `--help-config=` too
        # its optional value takes the next argument, so an override after it arrives here
        alone = "lists the config fields and runs nothing; give it alone"
        if args.help_config not in ("text", "markdown"):
            raise TailtamerError(f"--help-config takes text or markdown, got {args.help_config!r}; it {alone}")
        if args.items or args.set or args.resume is not None:
            raise TailtamerError(f"--help-config {alone}")
        print(config_reference() if args.help_config == "markdown" else "\n".join(config_help()), end="" if
              args.help_config == "markdown" else "\n")
        return
    items = list(args.items)
    path = items.pop(0) if items and "=" not in items[0] else None
    items += args.set
    if args.resume is not None and not args.resume.strip():
        raise TailtamerError("--resume: empty path; give the run directory (e.g. runs/default)")
    resume = Path(args.resume) if args.resume else None
    if resume is not None:
        if path is not None:
            raise TailtamerError("--resume takes its config from the run directory; give only key=value overrides")
        path = resume / "config.yaml"
        if not path.is_file():
            run = run_holding(resume) if resume.exists() else None
            logs = kept_logs(run or resume)
            if logs:
                raise TailtamerError(f"--resume {resume}: the run {run or resume} ended before its first step and "
                                     f"keeps only {' and '.join(logs)}: nothing to resume; run it again without --resume")
            if run is not None:  # a checkpoint or other file of a run
                latest = run / "checkpoints" / "latest"
                pick = (f"; to resume from {resume.name}, write its name into {latest}"
                        if resume.absolute().parent.name == "checkpoints" and resume.name.startswith("step-") else "")
                raise TailtamerError(f"--resume {resume}: inside the run directory {run}, which resumes from the "
                                     f"checkpoint {latest} names; give --resume {run}{pick}")
            what = ("is a file" if resume.is_file() else "no such directory" if not resume.is_dir()
                    else "not a run directory (it has no config.yaml)")
            raise TailtamerError(f"--resume {resume}: {what}; give a run's directory, e.g. runs/default")
    cfg = load_train_config(path, items, written=resume is not None)
    summary = launch(cfg, resume, console=None if sys.stderr.isatty() else print)
    if summary is not None:  # worker 0 (under torchrun every worker runs this)
        print(json.dumps(summary, indent=2))


def cmd_drafter_train(args) -> None:
    from dataclasses import replace

    from tailtamer.atomic import atomic_write_json
    from tailtamer.drafter.train import (DrafterTrainConfig, check_unroll, encode_texts, read_texts, train_drafter,
                                         training_state)
    from tailtamer.model.drafter import check_drafter_dir, load_drafter, save_drafter
    from tailtamer.model.io import load_pretrained

    for flag, value in (("--steps", args.steps), ("--unroll", args.unroll)):
        if value is not None:
            at_least_one(value, flag)
    if args.unroll is not None:
        check_unroll(args.unroll, "--unroll")
    if args.init:  # before the model loads, named by its flag
        check_drafter_dir(args.init, f"--init {args.init}")
    fresh_output_dir(args.out, "--out")
    cfg = replace(DrafterTrainConfig(fc_bias=not args.no_fc_bias),
                  **{k: v for k, v in (("steps", args.steps), ("lr", args.lr), ("seed", args.seed), ("unroll", args.unroll))
                     if v is not None})
    model, tokenizer = load_pretrained(args.model)
    if args.data == "builtin":
        from tailtamer.tasks.arithmetic import ArithmeticTask

        texts = [p["prompt"] + p["trace"] for p in ArithmeticTask().dataset(4000, seed=cfg.seed + 7)]
    else:
        texts = read_texts(args.data)
    start = load_drafter(args.init, model) if args.init else None
    if start is not None and args.no_fc_bias and start.fc.bias is not None:
        raise TailtamerError(f"--no-fc-bias: --init {args.init}'s drafter has an fc bias, which training keeps; "
                             f"leave out --init to train a drafter without one")
    try:
        # cut to the target's context too: positions past it have no meaning for the target
        seqs = encode_texts(tokenizer, texts, min(cfg.max_len, model.config.max_position_embeddings))
        state = training_state(args.out, model, seqs, cfg, start)  # where a stop saves, and the command goes on
        drafter, info = train_drafter(model, seqs, cfg, drafter=start, state=state)
    except DataError as e:  # about the texts: name where they came from
        raise DataError(f"--data {args.data}: {e}") from None

    def write(tmp: Path) -> None:
        save_drafter(drafter, tmp)
        atomic_write_json(tmp / "train.json", info)

    state.write(args.out, write, "the drafter", print)
    print(f"wrote the drafter to {args.out} (top-1 agreement with the target {info['final']['top1']:.1%})")


def cmd_sft(args) -> None:
    from dataclasses import replace

    from tailtamer.sft import SFTConfig, ensure_base_model, write_base_model

    given = {"steps": args.steps, "habit_steps": args.habit_steps, "seed": args.seed, "preset": args.preset}
    if args.steps is not None:
        at_least_one(args.steps, "--steps")
    if args.habit_steps is not None and args.habit_steps < 0:
        raise TailtamerError(f"--habit-steps must be >= 0, got {args.habit_steps}")
    cfg = replace(SFTConfig(), **{k: v for k, v in given.items() if v is not None})
    if args.out:
        fresh_output_dir(args.out, "--out")
        info = write_base_model(cfg, Path(args.out))
        print(f"wrote the base model to {args.out} (final loss {info['final_loss']:.4f})")
    else:
        print(ensure_base_model(cfg))


def cmd_init_model(args) -> None:
    from tailtamer.atomic import write_dir, writing
    from tailtamer.model.config import preset_config
    from tailtamer.model.io import init_model, save_model
    from tailtamer.model.tokenizer import char_tokenizer, load_tokenizer

    if args.tokenizer and not Path(args.tokenizer).is_dir():  # load_tokenizer would call it a model directory
        raise TailtamerError(f"--tokenizer {args.tokenizer}: not a directory (give the one holding tokenizer.json)")
    fresh_output_dir(args.out, "--out")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else char_tokenizer()
    arch = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[args.arch]
    cfg = preset_config(args.preset, tokenizer.vocab_size, architecture=arch,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = init_model(cfg, seed=args.seed)

    def write(tmp: Path) -> None:
        save_model(model, tmp)
        tokenizer.save(tmp)

    with writing("the model", args.out):  # an interrupt leaves no half-written model to trip on
        write_dir(Path(args.out), write)
    print(f"wrote a random {args.preset} {arch} ({cfg.num_parameters() / 1e6:.2f}M parameters) to {args.out}")


# A task row's JSON line, 46.4 bytes on average (to refuse an --n the disk cannot hold).
TASK_ROW_BYTES = 47


def cmd_task(args) -> None:
    import shutil

    from tailtamer.atomic import atomic_write, writing
    from tailtamer.memory import size
    from tailtamer.tasks.arithmetic import ArithmeticTask

    output_file(args.out, "--out")
    n = at_least_one(args.n, "--n")
    directory = Path(os.path.realpath(args.out)).parent  # output_file made it
    free = shutil.disk_usage(directory).free
    if n * TASK_ROW_BYTES > free:
        raise TailtamerError(f"--n {n}: about {size(n * TASK_ROW_BYTES)} of prompts, more than the {size(free)} free "
                             f"in {directory}; lower --n")

    def write(tmp: str) -> None:  # row by row: a large --n never sits in memory
        with open(tmp, "w", encoding="utf-8") as f:
            for r in ArithmeticTask().problems(n, args.seed):
                f.write(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n")

    with writing("the task prompts", args.out):
        atomic_write(args.out, write)
    print(f"wrote {n} built-in task prompts to {args.out}")


def cmd_demo(args) -> None:
    from tailtamer.demo import DEMO_MAX_NEW_TOKENS, OUTPUT_FILES, run_demo

    at_least_one(args.prompts, "--prompts")
    at_least_one(args.n, "--n")
    check_responses_fit(args.prompts, args.n, DEMO_MAX_NEW_TOKENS, "lower --prompts or --n")
    fresh_output_dir(args.out, "--out", ours=OUTPUT_FILES, inputs={"--model": args.model} if args.model else {})
    run_demo(out_dir=Path(args.out), n_prompts=args.prompts, n=args.n, seed=args.seed,
             model=Path(args.model) if args.model else None)


def cmd_bench(args) -> None:
    from tailtamer.bench import (ROLLOUT_ARMS, SD_BATCHES, bench_decode, bench_random_model, bench_rollout, bench_sd,
                                 check_arms)
    from tailtamer.bench_train import bench_train
    from tailtamer.model.drafter import check_drafter_dir

    if args.preset and args.model:
        raise TailtamerError("give --model or --preset, not both")
    if args.what == "train" and (args.model or args.preset):
        raise TailtamerError("bench train runs the built-in default job; change it with --set key=value")
    given = {"--model": args.model, "--preset": args.preset, "--drafter": args.drafter, "--steps": args.steps,
             "--new-tokens": args.new_tokens, "--set": args.set or None, "--group": args.group, "--arms": args.arms}
    for flag, value in given.items():  # a flag a benchmark would ignore is a mistake to say, not to skip
        if value is not None and args.what not in BENCH_FLAGS[flag]:
            raise TailtamerError(f"{flag} is for bench {', '.join(BENCH_FLAGS[flag])}, not bench {args.what}")
    steps_given = args.steps is not None
    args.steps = 10 if args.steps is None else at_least_one(args.steps, "--steps")
    args.new_tokens = 64 if args.new_tokens is None else at_least_one(args.new_tokens, "--new-tokens")
    at_least_one(args.repeats, "--repeats")
    args.group = 8 if args.group is None else at_least_one(args.group, "--group")
    if args.group > max(SD_BATCHES):  # every batch would run one problem's `group` siblings: hours, memory
        raise TailtamerError(f"--group {args.group}: at most {max(SD_BATCHES)}, bench sd's largest batch, whose "
                             f"{max(SD_BATCHES)} requests then share one problem")
    check_arms(args.arms or (), "--arms")
    # bench rollout's arms other than plain all draft with the EAGLE drafter
    drafts = args.what in ("sd", "profile") or (args.what == "rollout" and set(args.arms or ROLLOUT_ARMS) != {"plain"})
    if args.drafter and not drafts:
        raise TailtamerError("--drafter: bench rollout --arms plain drafts nothing; leave out --drafter")
    if args.what == "profile" and args.model and steps_given:
        raise TailtamerError("--steps: bench profile --model times decode steps only (the RL steps are the built-in "
                             "job's); leave out --steps or --model")
    if args.drafter:  # before the model loads, named by its flag
        check_drafter_dir(args.drafter, f"--drafter {args.drafter}")
    if drafts and args.model and not args.drafter:  # the built-in drafter is trained for the built-in model
        raise TailtamerError(f"bench {args.what} --model {args.model} needs --drafter DIR, an EAGLE drafter of that "
                             f"model (tailtamer drafter train --model {args.model} --data ... --out DIR)")
    if args.out is not None:
        from tailtamer.bench_profile import RUNS as PROFILE_RUNS
        from tailtamer.bench_train import RUNS as TRAIN_RUNS

        own = {"train": TRAIN_RUNS, "profile": PROFILE_RUNS}.get(args.what)  # its runs go there
        output_file(args.out, "--out", {k: v for k, v in (("--model", args.model), ("--drafter", args.drafter),
                                                         (f"bench {args.what}'s runs", own)) if v})
    if args.what == "profile":
        from tailtamer.bench_profile import bench_profile

        if args.steps < 2 and not args.model:  # the first step, which warms up, is left out
            raise TailtamerError(f"--steps must be >= 2 for bench profile, got {args.steps}")
        report = bench_profile(args.model, rl_steps=0 if args.model else args.steps, repeats=args.repeats,
                               drafter_dir=args.drafter)
    elif args.what == "train":
        report = bench_train(args.steps, args.repeats, overrides=tuple(args.set))
    elif args.what == "rollout":
        report = bench_rollout(args.model, repeats=args.repeats, drafter_dir=args.drafter,
                               arms=tuple(args.arms or ROLLOUT_ARMS))
    elif args.what == "sd":
        report = bench_sd(args.model, repeats=args.repeats, drafter_dir=args.drafter,
                          group=args.group)
    elif args.preset:
        report = bench_random_model(args.preset, args.repeats, args.new_tokens)
    else:
        report = bench_decode(args.model, args.repeats, args.new_tokens)
    print(json.dumps(report, indent=2))
    if args.out:
        from tailtamer.atomic import atomic_write_json

        atomic_write_json(args.out, report)


class _Parser(argparse.ArgumentParser):
    """A usage mistake is one line, like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from tailtamer.bench import ROLLOUT_ARMS
    from tailtamer.drafter.train import DrafterTrainConfig
    from tailtamer.rollout.engine import EngineConfig
    from tailtamer.sft import SFTConfig

    from tailtamer import __version__

    p = _Parser(prog="tailtamer", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"tailtamer {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    tr = sub.add_parser("train", help="GRPO-family RL; no arguments = the built-in default job")
    tr.add_argument("items", nargs="*", help="[CONFIG.yaml] [section.key=value ...]")
    tr.add_argument("--resume", help="continue the run in this directory from its last checkpoint")
    tr.add_argument("--help-config", nargs="?", const="text", metavar="{text,markdown}",
                    help="list every config field with its default and help (markdown: docs/config.md)")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override, as `bench train --set` takes them (one per --set; the same as KEY=VALUE)")
    tr.set_defaults(func=cmd_train)

    g = sub.add_parser("generate", help="sample completions for a prompts file")
    g.add_argument("--model", type=nonempty, required=True, help="HF-format model directory")
    g.add_argument("--prompts", type=nonempty, required=True, help='JSONL, rows {"prompt": str} or {"messages": [...]}')
    g.add_argument("--out", required=True, help="output JSONL, one row per sample")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--seed", type=seed, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when this PyTorch has a GPU, else cpu)")
    g.add_argument("--max-batch-size", type=int, default=EngineConfig().max_batch_size,
                   help="requests decoded together (default %(default)s)")
    g.add_argument("--stats", type=nonempty, help="write throughput and the running-requests timeline as JSON")
    g.set_defaults(func=cmd_generate)

    g.add_argument("--backend", default="tailtamer", choices=["tailtamer", "vllm"],
                   help="the engine: tailtamer (embedded) or vllm (in the environment `make vllm-env` creates)")
    g.add_argument("--spec", default="off", choices=["off", "on", "adaptive"], help="speculative decoding")
    g.add_argument("--strategy", type=nonempty, help="--spec on (or --tuner fixed): the draft tree, DEPTH_TOPK_VERIFY (EAGLE), "
                   "D_K_N@C (drafted as deep as the drafter is confident), sD_K_N (the suffix drafter) or D_K_N+sM "
                   "(M suffix drafts fused into the EAGLE tree); default 4_2_8, with --drafter suffix s8_2_9, with "
                   "--backend vllm 4_1_5")
    g.add_argument("--strategies", nargs="+", metavar="ARM", help="--spec adaptive: the bandit's arms, written as "
                   "--strategy (default: spec.strategies' default for the drafter and backend, docs/config.md)")
    g.add_argument("--drafter", type=nonempty, help="EAGLE drafter directory, or 'suffix' (model-free: siblings and the request's own "
                                     "text); with --backend vllm 'ngram' (vLLM's prompt lookup)")
    g.add_argument("--bs-threshold", type=int, default=SpecConfig().bs_threshold,
                   help="adaptive: speculate once at most this many requests are running (default: "
                        f"{GPU_BS_THRESHOLD} on a GPU or with --tuner fixed, every batch size on a CPU)")
    g.add_argument("--tuner", choices=["beg", "fixed"], help="adaptive: the strategy's choice, beg (the bandit, "
                   "the default) or fixed (--strategy)")
    g.add_argument("--compile", action="store_true", help="EAGLE: compile the draft chains (spec.compile); with "
                                                          "--backend vllm, vLLM compiles its model (vllm.compile)")
    g.add_argument("--kv-cache-gb", type=float, help=f"--backend vllm: vLLM's KV cache, GiB (vllm.kv_cache_gb; "
                                                     f"default {VLLMConfig().kv_cache_gb:g})")

    dr = sub.add_parser("drafter", help="drafter tools")
    dsub = dr.add_subparsers(dest="drafter_command", required=True, parser_class=_Parser, metavar="COMMAND")
    dt = dsub.add_parser("train", help="offline warm-up of an EAGLE drafter on the target's hidden states")
    dt.add_argument("--model", type=nonempty, required=True, help="target model directory")
    dt.add_argument("--data", type=nonempty, required=True, help="JSONL with 'text' (or 'prompt' + 'response'), or 'builtin'")
    dt.add_argument("--out", required=True, help="drafter directory to write")
    dt.add_argument("--init", type=nonempty, help="continue from this drafter directory")
    dt.add_argument("--steps", type=int, help=f"optimizer steps (default {DrafterTrainConfig().steps})")
    dt.add_argument("--lr", type=float, help=f"peak AdamW learning rate (default {DrafterTrainConfig().lr})")
    dt.add_argument("--seed", type=seed, help="data order and initialisation")
    dt.add_argument("--unroll", type=int, help=f"drafting levels trained per pair, the later ones on the drafter's "
                                               f"own features (default {DrafterTrainConfig().unroll}; 1: EAGLE-1's)")
    dt.add_argument("--no-fc-bias", action="store_true",
                    help="no bias in the drafter's fc: vLLM's EAGLE loader has none (for --backend vllm)")
    dt.set_defaults(func=cmd_drafter_train)

    s = sub.add_parser("sft", help="train (or find in the cache) the built-in task's base model")
    s.add_argument("--out", type=nonempty, help="train into this directory instead of the cache")
    s.add_argument("--steps", type=int, help=f"steps on worked traces (default {SFTConfig().steps})")
    s.add_argument("--habit-steps", type=int, help="then steps where the teacher often answers directly "
                                                    f"(default {SFTConfig().habit_steps}; 0 = no habit for RL to unlearn)")
    s.add_argument("--seed", type=seed)
    s.add_argument("--preset", type=preset, help=f"model size (default {SFTConfig().preset}; see init-model)")
    s.set_defaults(func=cmd_sft)

    i = sub.add_parser("init-model", help="write a randomly initialised model of a preset size")
    i.add_argument("--preset", type=preset, required=True)
    i.add_argument("--out", required=True)
    i.add_argument("--arch", default="qwen2", choices=["qwen2", "qwen3", "llama"])
    i.add_argument("--tokenizer", type=nonempty, help="directory with tokenizer.json (default: the built-in character tokenizer)")
    i.add_argument("--seed", type=seed, default=0)
    i.set_defaults(func=cmd_init_model)

    t = sub.add_parser("task", help="write built-in task prompts as JSONL")
    t.add_argument("--out", required=True)
    t.add_argument("--n", type=int, default=64)
    t.add_argument("--seed", type=seed, default=0)
    t.set_defaults(func=cmd_task)

    d = sub.add_parser("demo", help="one long-tail rollout of the built-in base model (the RL job is `tailtamer train`)")
    d.add_argument("--out", default="runs/demo", help="directory for its completions.jsonl, report.json and timeline.json (default runs/demo)")
    d.add_argument("--prompts", type=int, default=64, help="how many built-in task prompts (a count, not a file)")
    d.add_argument("--n", type=int, default=8, help="samples per prompt")
    d.add_argument("--seed", type=seed, default=0, help="which prompts, and the sampling streams")
    d.add_argument("--model", type=nonempty, help="model directory (default: the built-in base model)")
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="side-by-side benchmarks; prints a JSON report of ratios")
    b.add_argument("what", choices=["decode", "sd", "rollout", "train", "profile"], metavar="BENCHMARK",
                   help="decode, sd, rollout, train or profile")
    b.add_argument("--model", type=nonempty, help="model directory (default: the built-in base model)")
    b.add_argument("--drafter", type=nonempty, help="sd, rollout, profile: the EAGLE drafter of --model (needed with it)")
    b.add_argument("--preset", type=preset, help="benchmark a random model of this preset size instead")
    b.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (medians)")
    b.add_argument("--new-tokens", type=int, help="decode: tokens per sequence (default 64)")
    b.add_argument("--group", type=int, help="sd: siblings per problem of the grouped workload, as GRPO samples "
                                            "(default 8; 1: the single workload only)")
    b.add_argument("--arms", nargs="+", metavar="ARM", help="rollout: the arms to run, after the benchmark's name; "
                                                           f"plain always runs (default: all of {', '.join(ROLLOUT_ARMS)})")
    b.add_argument("--out", type=nonempty, help="also write the report here")
    b.add_argument("--steps", type=int, help="train, profile: RL steps per run (default 10; profile: >= 2)")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="train: a config override (repeatable)")
    b.set_defaults(func=cmd_bench)
    return p


def _run(args) -> None:
    CREATED.clear()
    try:
        args.func(args)
    except BaseException:
        remove_empty_dirs(CREATED)
        raise


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line; an unknown argument is named with the command it was given
    to (`tailtamer bench`, not `tailtamer`, whose parser would otherwise report it)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    # options before the command are tailtamer's own: argparse would first say a command is
    # missing, or print the version, and never name them
    lead = list(itertools.takewhile(lambda a: a.startswith("-"), argv))
    stray = [a for a in lead if a not in ("-h", "--help", "--version")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        last = len(argv) - 1 - argv[::-1].index(unknown[-1])  # the token may also be a value given before it
        parsers = [parser]
        for name in (args.command, getattr(args, "drafter_command", None)):
            if name is None or last < argv.index(name):  # given before the command's name
                break
            sub = next(a for a in parsers[-1]._actions if isinstance(a, argparse._SubParsersAction))
            parsers.append(sub.choices[name])
        parsers[-1].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        with sigterm_stops_at_once():
            _run(args)
        if sys.stdout is not None:  # None when started with stdout closed
            sys.stdout.flush()  # a closed pipe is said here, not at the interpreter's exit
    except Interrupted as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every worker stops alike: one says so
            print(e, file=sys.stderr)  # "stopped by ... after step N; ..."
        return 130
    except KeyboardInterrupt as e:
        print(f"stopped: interrupted ({'SIGTERM' if isinstance(e, Terminated) else 'Ctrl-C'}); files are written "
              f"atomically, so nothing is half-written", file=sys.stderr)
        return 130
    except TailtamerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not stdout_closed():  # another pipe (a worker's, a reward process's): not the reader's choice
            raise
        if args.command == "train" and args.help_config is None:
            print(f"stopped: {CLOSED_PIPE}", file=sys.stderr)
        return 141  # as the shell reports a process that SIGPIPE ended
    return 0
