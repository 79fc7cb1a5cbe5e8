"""`tailtamer bench train`: the whole RL step of the default job, SD on against SD off.

The two arms run as two training processes (`python -m tailtamer.bench_train DIR:ARM:ARMS
key=value ...`, which hands the trainer a `tailtamer.pace.Pace`) that take turns step by step:
step i of one arm runs alone, then step i of the other, seconds apart, so the VM's drift over
minutes falls on both. Which arm goes first alternates repeat by repeat.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tailtamer.errors import ConfigError, TailtamerError
from tailtamer.stopping import STOPPING, Interrupted, Terminated, exit_with_parent

ARMS = {"sd": [], "off": ["spec.mode=off"]}
# What `bench train` sets for each arm; an override of one would break the comparison.
BENCH_FIELDS = ("run.steps", "run.name", "run.out_dir", "spec.mode")


def run_paced(jobs: dict[str, list[str]], logs: dict[str, Path], timeout_s: float | None = None) -> None:
    """Train every job at once (`arm_main`), taking turns step by step; the first job (in
    order) goes first. A job that fails stops the others; its log's last line
    is the error. No timeout by default: a long tail may take as long as it takes."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="tailtamer-pace-") as pace:
        (Path(pace) / "turn").write_text("0")
        procs = {}
        try:
            for arm, (name, args) in enumerate(jobs.items()):
                with open(logs[name], "w") as log:
                    # its own process group (setsid): a terminal's Ctrl-C reaches bench train alone, which stops the arms
                    procs[name] = subprocess.Popen([sys.executable, "-m", "tailtamer.bench_train",
                                                    f"{pace}:{arm}:{len(jobs)}", *args],
                                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})  # a live log
            while True:
                failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
                if failed:
                    lines = logs[failed[0]].read_text().strip().splitlines() or ["(no output)"]
                    raise TailtamerError(f"bench train: the {failed[0]} arm failed ({logs[failed[0]]}): {lines[-1]}")
                running = [n for n, p in procs.items() if p.poll() is None]
                if not running:
                    return
                if deadline is not None and time.monotonic() > deadline:
                    raise TailtamerError(f"bench train: the {', '.join(running)} arm(s) took longer than {timeout_s} s "
                                         f"({', '.join(str(logs[n]) for n in running)})")
                time.sleep(0.2)
        except KeyboardInterrupt as e:
            by = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
            where = next(iter(logs.values())).parent
            raise Interrupted(f"stopped by {by}: bench train's runs in {where} end where they were (the next bench "
                              f"train replaces them); no report", by) from None
        finally:
            _stop(procs, logs)


# An arm given a stop at once ends within this (after the first Ctrl-C is heard: within this too); then it is killed.
STOP_GRACE_S = 10.0


def _stop(procs: dict[str, subprocess.Popen], logs: dict[str, Path]) -> None:
    """End the arms still running with the trainer's stop at once, two Ctrl-Cs, so that each
    unwinds (its workers, its queues' semaphores) rather than leave a killed process's debris in
    its log. The second is sent once the first was heard (the arm says so): two signals that
    arrive during one long torch call reach Python's handler as one. Killed when an arm has
    not ended within STOP_GRACE_S."""
    running = {name: p for name, p in procs.items() if p.poll() is None}
    said = {name: logs[name].stat().st_size for name in running}  # what each log held before the signal
    for p in running.values():
        p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    for name, p in running.items():
        with open(logs[name], "rb") as log:
            log.seek(said[name])
            heard = b""
            while p.poll() is None and time.monotonic() < deadline and STOPPING.encode() not in heard:
                time.sleep(0.05)
                heard += log.read()
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in running.values():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


RUNS = "runs/bench-train"  # where its runs go (sd-N, off-N), replaced by its next run


def bench_train(steps: int = 10, repeats: int = 1, out_dir: str = RUNS,
                overrides: tuple[str, ...] = ()) -> dict:
    """The whole RL step of the built-in default job (this machine's default workers, adaptive
    SD, adaptive drafter) against the same job with SD off (`spec.mode=off`), step by step in
    turns. Same seeds: SD is lossless, so the two reward curves should agree step for step
    (float32 verification may round a rare token differently). Speedups: the ratio of the
    arms' median steps over every step of every repeat, and the median of the per-step ratios
    (step i off / step i SD, seconds apart)."""
    from tailtamer.bench import progress
    from tailtamer.config import load_train_config
    from tailtamer.rl.run_state import prepare

    fixed = [item for item in overrides if item.split("=", 1)[0].strip() in BENCH_FIELDS]
    if fixed:
        raise ConfigError(f"--set {fixed[0]}: bench train sets {', '.join(BENCH_FIELDS)} itself (--steps, its own "
                          f"run names and directory, SD on against off); --set changes the rest of the job")

    def args(name: str, r: int) -> list[str]:
        return [f"run.steps={steps}", f"run.name={name}-{r}", f"run.out_dir={out_dir}", "run.eval_every=0",
                "run.save_every=0", *overrides, *ARMS[name]]

    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise TailtamerError(f"{out_dir}: bench train keeps its runs in this directory, but it is a file; move it away")
    for run in (Path(out_dir) / f"{name}-{r}" for r in range(repeats) for name in ARMS):  # before minutes of work
        check_replaceable(run)
    # once, here: the base model's SFT and the drafter's warm-up on a first run (cached; minutes,
    # said on stderr as `make demo` says it), and a bad --set refused in one line before anything starts
    for name in ARMS:
        prepare(load_train_config(None, args(name, 0)), log=progress)
    rows: dict[str, list[list[dict]]] = {k: [] for k in ARMS}
    for r in range(repeats):
        order = list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]
        for name in order:
            shutil.rmtree(Path(out_dir) / f"{name}-{r}", ignore_errors=True)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        run_paced({name: args(name, r) for name in order}, {name: Path(out_dir) / f"{name}-{r}.log" for name in order})
        for name in ARMS:
            metrics = Path(out_dir) / f"{name}-{r}" / "metrics.jsonl"
            rows[name].append([json.loads(line) for line in metrics.read_text().splitlines()])
    return train_report(rows, steps, repeats, overrides, out_dir)


def check_replaceable(run: Path, what: str = "bench train") -> None:
    """A benchmark (`what`) replaces its earlier runs (bench train's `sd-N`, `off-N` in its
    directory, bench profile's), and nothing else: a directory there holding anything but a
    run's own files is refused in one line, as is a file where its directory belongs."""
    from tailtamer.rl.run_dir import RUN_DIRS, RUN_FILES

    if not run.exists() and not run.is_symlink():
        return
    if run.is_symlink() or not run.is_dir():
        raise TailtamerError(f"{run}: {what} replaces its earlier runs there, but this is "
                             f"{'a symlink' if run.is_symlink() else 'a file'}, not a run directory; move it away")
    ours = {*RUN_FILES, *RUN_DIRS, ".lock"}
    # with what a killed write of one of them leaves: a hidden temporary .NAME.XXXX(.tmp) (tailtamer.atomic)
    foreign = sorted(p.name for p in run.iterdir()
                     if p.name not in ours and not any(p.name.startswith(f".{name}.") for name in ours))
    if foreign:
        raise TailtamerError(f"{run}: {what} replaces its earlier runs there, but it holds {', '.join(foreign[:3])}"
                             f"{' ...' * (len(foreign) > 3)}, not a run's files; move them away")


def median_interval(values: list[float], level: float = 0.95, resamples: int = 2000, seed: int = 0) -> list[float]:
    """A percentile-bootstrap interval for the median of `values` (Efron & Tibshirani 1993,
    ch. 13): medians of `resamples` draws with replacement, cut at (1 ± level) / 2. With a
    few dozen per-step ratios it says whether a difference of a few percent is resolved."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    cut = int((1 - level) / 2 * resamples)
    return [medians[cut], medians[resamples - 1 - cut]]


def train_report(rows: dict[str, list[list[dict]]], steps: int, repeats: int, overrides, out_dir: str) -> dict:
    def median(name, key):
        return statistics.median(row.get(key) or 0.0 for run in rows[name] for row in run)  # no drafter: null

    def total(name):
        return sum(row["step_s"] for run in rows[name] for row in run)

    paired = [(a, b) for run_sd, run_off in zip(rows["sd"], rows["off"]) for a, b in zip(run_sd, run_off)]
    pairs = [b["step_s"] / a["step_s"] for a, b in paired]
    sd = rows["sd"][0]
    return {
        "steps": steps, "repeats": repeats, "workers": sd[0]["workers"], "overrides": list(overrides),
        "step_s_median": {k: round(median(k, "step_s"), 3) for k in ARMS},
        "rollout_s_median": {k: round(median(k, "rollout_s"), 3) for k in ARMS},
        "step_speedup": round(median("off", "step_s") / median("sd", "step_s"), 3),
        "step_speedup_paired": round(statistics.median(pairs), 3),
        "step_speedup_paired_quartiles": [round(q, 3) for q in statistics.quantiles(pairs, n=4)] if len(pairs) > 1
        else [],
        "step_speedup_paired_ci95": [round(x, 3) for x in median_interval(pairs)],
        "step_speedup_per_repeat": [round(statistics.median(row["step_s"] for row in a)
                                          / statistics.median(row["step_s"] for row in b), 3)
                                    for a, b in zip(rows["off"], rows["sd"])],
        "rollout_speedup": round(median("off", "rollout_s") / median("sd", "rollout_s"), 3),
        # every step of every repeat summed, the first ones included (what the medians leave
        # out: a step that compiles); start-up and the drafter's warm-up are in no step
        "all_steps_s": {k: round(total(k), 2) for k in ARMS},
        "all_steps_speedup": round(total("off") / total("sd"), 3),
        "reward_mean": {k: round(statistics.mean(row["reward_mean"] for row in rows[k][0]), 4) for k in ARMS},
        # every step of every repeat: SD is lossless, so each should agree with its SD-off twin
        "steps_with_equal_rewards": sum(a["reward_mean"] == b["reward_mean"] for a, b in paired) / len(paired),
        "reward_max_abs_diff": max(abs(a["reward_mean"] - b["reward_mean"]) for a, b in paired),
        "sd_tokens_frac_median": round(median("sd", "sd_tokens_frac"), 3),
        "accept_len": [round(row["accept_len_mean"], 3) for row in sd],
        "accept_len_est_adaptive": [round(row["accept_len_est"], 3) for row in sd
                                    if row.get("accept_len_est") is not None],
        "accept_len_est_frozen": [round(row["accept_len_est_frozen"], 3) for row in sd
                                  if row.get("accept_len_est_frozen") is not None],
        "idle_worker_s_median": round(median("sd", "idle_worker_s"), 3),
        "rollout_tail_s_median": {k: round(median(k, "rollout_tail_s"), 3) for k in ARMS},
        "train_s_median": {k: round(median(k, "train_s"), 3) for k in ARMS},
        "drafter_train_s_median": round(median("sd", "drafter_train_s"), 3),
        "drafter_preempt_s_max": max((row.get("drafter_preempt_s") or 0.0) for run in rows["sd"] for row in run),
        "run_dirs": {k: str(Path(out_dir) / f"{k}-0") for k in ARMS},
    }


def arm_main(argv: list[str]) -> int:
    """One arm: `tailtamer train key=value ...` that takes its turns (argv: the pace's
    DIR:ARM:ARMS, then the overrides). Its last line is its summary, or `error: ...`."""
    from tailtamer.config import load_train_config
    from tailtamer.pace import Pace
    from tailtamer.rl.trainer import launch

    exit_with_parent(os.getppid())  # in a process group of its own: a killed bench train's arms would go on
    try:
        summary = launch(load_train_config(None, argv[1:]), console=print, pace=Pace(argv[0]))
    except Interrupted as e:
        print(e, file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("stopped: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except TailtamerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(arm_main(sys.argv[1:]))
