"""What a run reports: the per-step console line under a progress bar, `metrics.jsonl`, the
optional TensorBoard / W&B loggers, and `summary.json`.

Loggers form a registry (`run.loggers=[tensorboard,wandb]`); each is off unless named, and a
missing package is a start-up error that says what to install, never a crash at step 1.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Callable

from tailtamer.atomic import atomic_write_text
from tailtamer.errors import ConfigError


class Rows:
    """An append-only JSONL file whose rows are written whole or not at all: unbuffered, each
    append one write (a killed run keeps every finished row), and one that fails (a full disk)
    cut back off, so no torn row is left and closing has nothing left to flush."""

    def __init__(self, path: Path):
        self.file = open(path, "ab", buffering=0)

    def append(self, rows: list[dict]) -> None:
        data = memoryview("".join(json.dumps(row) + "\n" for row in rows).encode())
        end = self.file.seek(0, os.SEEK_END)
        try:
            while data:
                data = data[self.file.write(data):]
        except BaseException:  # a full disk, or a Ctrl-C between two partial writes
            self.file.truncate(end)
            raise

    def close(self) -> None:
        self.file.close()


class JsonlLogger:
    """metrics.jsonl: one JSON row per RL step."""

    def __init__(self, run_dir: Path, cfg_dict: dict):
        self.rows = Rows(run_dir / "metrics.jsonl")

    def log(self, row: dict) -> None:
        self.rows.append([row])

    def close(self) -> None:
        self.rows.close()


class SamplesLogger:
    """samples.jsonl: what the model wrote, a row per logged sample with its step."""

    def __init__(self, run_dir: Path, cfg_dict: dict):
        self.rows = Rows(run_dir / "samples.jsonl")

    def log_samples(self, step: int, samples: list[dict]) -> None:
        self.rows.append([{"step": step, **sample} for sample in samples])

    def close(self) -> None:
        self.rows.close()


def samples_markdown(samples: list[dict]) -> str:
    """A Markdown table of samples (TensorBoard renders text summaries as Markdown)."""
    cell = lambda text: str(text).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
    lines = ["| prompt | response | reward | length |", "|---|---|---|---|"]
    lines += [f"| {cell(x['prompt'])} | {cell(x['response'])} | {x['reward']:.3g} | {x['length']} |" for x in samples]
    return "\n".join(lines)


# TensorBoard / W&B panel groups: the first rule a metrics.jsonl key matches names its group
# (the key itself stays as it is, so a tag reads the same as the JSON field).
TAG_GROUPS = (
    ("drafter", lambda k: k.startswith(("drafter_", "accept_len_est"))),
    ("time", lambda k: k.endswith("_s")),
    ("reward", lambda k: k.startswith("reward")
     or k in ("accuracy", "eval_accuracy", "kept_groups_frac", "zero_adv_frac")),
    ("rollout", lambda k: k.startswith(("response_len", "accept_len", "sd_tokens")) or k == "truncated_frac"),
    ("train", lambda k: True),
)


def tag(key: str) -> str:
    """`group/key` for a metrics.jsonl key (`reward/accuracy`, `time/step_s`); a key that
    already names its group (`reward_fn/<function>`) is kept."""
    if "/" in key:
        return key
    return next(f"{group}/{key}" for group, matches in TAG_GROUPS if matches(key))


def _scalars(row: dict) -> dict[str, float]:
    return {tag(k): float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v)}


class TensorBoardLogger:
    def __init__(self, run_dir: Path, cfg_dict: dict, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run logs again the steps after its checkpoint: their first events go.
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step + 1 if first_step else None)

    def log(self, row: dict) -> None:
        for key, value in _scalars(row).items():
            self.writer.add_scalar(key, value, row["step"])
        self.writer.flush()

    def log_samples(self, step: int, samples: list[dict]) -> None:
        self.writer.add_text("rollout/samples", samples_markdown(samples), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Offline by default (no account needed); `WANDB_MODE=online` syncs as usual.

    The W&B run's id is kept in `wandb-id` in the run directory, so a resumed run (online)
    continues the same W&B run, as verl and TRL resume theirs; the steps it takes again after
    its checkpoint were logged already and are not sent twice (W&B drops a step below its
    last with a warning). W&B cannot resume an offline run: offline, each resume is a new
    offline run with the same id."""

    def __init__(self, run_dir: Path, cfg_dict: dict, first_step: int):
        import os
        import uuid

        import wandb

        id_file = run_dir / "wandb-id"
        try:
            run_id = id_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            run_id = ""
        if not run_id:
            run_id = uuid.uuid4().hex[:8]
            atomic_write_text(id_file, run_id + "\n")
        mode = os.environ.get("WANDB_MODE", "offline")
        resume = {} if mode in ("offline", "dryrun", "disabled") else {"resume": "allow"}
        self.run = wandb.init(project="tailtamer", name=run_dir.name, dir=str(run_dir), config=cfg_dict,
                              mode=mode, id=run_id, **resume)
        # the next step W&B accepts: after the last it holds when this resumed it
        self.next_step = int(getattr(self.run, "step", 0) or 0) if getattr(self.run, "resumed", False) else 0

    def log(self, row: dict) -> None:
        if row["step"] >= self.next_step:
            self.run.log(_scalars(row), step=row["step"])

    def log_samples(self, step: int, samples: list[dict]) -> None:
        import wandb

        if step < self.next_step:
            return
        columns = ["prompt", "response", "reward", "length"]
        self.run.log({"rollout/samples": wandb.Table(columns=columns, data=[[x[c] for c in columns] for x in samples])},
                     step=step)

    def close(self) -> None:
        self.run.finish()


# name -> (logger class, the package it imports)
LOGGERS: dict[str, tuple[Callable, str]] = {
    "tensorboard": (TensorBoardLogger, "tensorboard"),
    "wandb": (WandbLogger, "wandb"),
}


def check_loggers(names: tuple[str, ...]) -> None:
    """Start-up check: every named logger exists and its package imports."""
    import importlib.util

    for name in names:
        if name not in LOGGERS:
            raise ConfigError(f"run.loggers: unknown logger {name!r}; choose from {sorted(LOGGERS)}")
        package = LOGGERS[name][1]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"run.loggers: {name} needs a package that is not installed "
                              f"(pip install \"tailtamer[{name}]\", or {package})")


class RunLog:
    """Fans a step's row out to metrics.jsonl, the named loggers, and the console. A named
    logger that fails to start stops the run before its first step; one that fails later
    (a lost connection, a full quota) is said once and dropped: the run, its metrics.jsonl and
    its checkpoints go on."""

    def __init__(self, run_dir: Path, names: tuple[str, ...], cfg_dict: dict, steps: int, first_step: int,
                 console: Callable[[str], None] | None):
        self.loggers = {}
        for name in dict.fromkeys(names):  # a name given twice (an older run's config.yaml) logs once
            try:
                self.loggers[name] = LOGGERS[name][0](run_dir, cfg_dict, first_step)
            except Exception as e:  # the logger's own error (W&B not logged in, say), not the run's
                raise ConfigError(f"run.loggers: {name} did not start ({type(e).__name__}: {e}); fix it, or "
                                  f"leave {name} out of run.loggers") from None
        self.metrics, self.samples = JsonlLogger(run_dir, cfg_dict), SamplesLogger(run_dir, cfg_dict)
        self.steps = steps
        self.bar = None
        self.console = console
        if console is None:  # the interactive CLI: a progress bar with the step lines above it
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=first_step, unit="step", dynamic_ncols=True, leave=False)
            self.console = self.bar.write

    def log(self, row: dict, samples: list[dict] = ()) -> None:
        self.metrics.log(row)
        if samples:
            self.samples.log_samples(row["step"], samples)
        for name in list(self.loggers):
            self._guarded(name, "log", lambda logger: self._log_to(logger, row, samples))
        self.console(console_line(row, self.steps))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{row['reward_mean']:.3f}", step_s=f"{row['step_s']:.1f}")

    @staticmethod
    def _log_to(logger, row: dict, samples: list[dict]) -> None:
        logger.log(row)
        if samples:
            logger.log_samples(row["step"], samples)

    def _guarded(self, name: str, what: str, call: Callable[[object], object]) -> None:
        """`call(logger)`; if it fails, the logger is said once and dropped (closed if it can be)."""
        logger = self.loggers[name]
        try:
            call(logger)
        except Exception as e:
            del self.loggers[name]
            if what != "close":
                try:
                    logger.close()
                except Exception:  # it failed already: what it says on closing adds nothing
                    pass
            rest = "it is dropped for the rest of the run" if what != "close" else "its own record may be incomplete"
            self.console(f"run.loggers: {name} failed to {what} ({type(e).__name__}: {e}); {rest} (metrics.jsonl "
                         f"has every step)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.samples.close()
        self.metrics.close()
        for name in list(self.loggers):
            self._guarded(name, "close", lambda logger: logger.close())


def console_line(row: dict, steps: int) -> str:
    extra = f"  eval {row['eval_accuracy']:.1%}" if "eval_accuracy" in row else ""
    if row.get("accept_len_mean", 1.0) > 1.0:
        extra += f"  accept {row['accept_len_mean']:.2f}"
    return (f"step {row['step']:4d}/{steps}  reward {row['reward_mean']:.3f}  acc {row['accuracy']:.1%}  "
            f"len p50 {row['response_len_p50']:.0f} max {row['response_len_max']:.0f}  "
            f"rollout {row['rollout_s']:.1f}s train {row['train_s']:.1f}s{extra}")


def run_summary(history: list[dict], eval_at_start: float | None, seconds: float, **extra) -> dict:
    """Start-vs-end figures of a run: mean train accuracy over the first and last fifth of the
    steps, held-out greedy accuracy before the first and after the last step, median step time."""
    h = history
    evals = [r["eval_accuracy"] for r in h if "eval_accuracy" in r]
    fifth = max(1, len(h) // 5)
    mean = lambda rows, key: statistics.mean(r[key] for r in rows) if rows else None  # noqa: E731
    return {
        "steps": len(h), "seconds": seconds,
        "accuracy_first_steps": mean(h[:fifth], "accuracy"),
        "accuracy_last_steps": mean(h[-fifth:], "accuracy"),
        "eval_accuracy_start": eval_at_start,
        "eval_accuracy_end": evals[-1] if evals else None,
        "step_s_median": statistics.median(r["step_s"] for r in h) if h else None,
        "rollout_s_median": statistics.median(r["rollout_s"] for r in h) if h else None,
        **extra,
    }
