"""Run directories: one run owns one directory, and a resumed run says what it changed.

A fresh run claims `run.out_dir/run.name` and holds an exclusive lock on its `.lock` file for
as long as it runs (the operating system drops the lock when the process dies, SIGKILL
included); `--resume` takes the same lock. So neither a second run with the same name nor a
second resume can write over a run's metrics and checkpoints. Without `run.name`, a run takes
the first free name of `default`, `default-2`, ...
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import yaml

from tailtamer.atomic import atomic_write_text, make_dirs, remove_empty_dirs
from tailtamer.config_fields import absolute_paths
from tailtamer.errors import ConfigError

DEFAULT_NAME = "default"


class RunDirBusy(ConfigError):
    """A run that is still going holds the directory's lock."""


# What a run writes before its first step ends: a directory of only these, its config naming
# it and no step's metrics in it, is a run killed in its first step (SIGTERM or SIGKILL).
REWARD_LOG = "reward.log"  # what the user's reward functions print
VLLM_LOG = "vllm.log"  # what vLLM's engines say (rollout.backend=vllm), every worker's lines marked
STARTED_FILES = {".lock", "config.yaml", "metrics.jsonl", "samples.jsonl", REWARD_LOG, VLLM_LOG, "tensorboard", "wandb",
                 "wandb-id"}
# What may say why a run failed before its first step: kept when the rest of its directory goes.
FAILURE_LOGS = (REWARD_LOG, VLLM_LOG)


class RunDirLock:
    """The claim of one run directory (held until `release` or the process's end)."""

    def __init__(self, path: Path, created: bool, made: list[Path] = ()):
        self.path, self.created = path, created
        self.made = made  # the directories the claim created: `path` and those above it (run.out_dir)
        self._fd: int | None = None

    def acquire(self) -> None:
        self._fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            self._fd = None
            raise RunDirBusy(f"{self.path} is in use by another tailtamer run (pid {holder}); wait for it to end "
                             f"or give another run.name") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self, remove_if_unused: bool = False) -> None:
        """Drop the lock; with `remove_if_unused`, remove a directory this claim created if the
        run finished no step in it (a run that failed at start-up or in its first step leaves
        no directory that would block its name), but for the logs that may say why it failed
        (FAILURE_LOGS: what its reward functions printed, what vLLM said; a directory holding
        only those and `.lock` is free for a new run). The lock is held until the directory is
        cleaned: a run claiming the name meanwhile is told it is busy."""
        if remove_if_unused and self.created and not finished_a_step(self.path):
            kept = [n for n in FAILURE_LOGS if (log := self.path / n).is_file() and log.stat().st_size]
            if not kept:
                shutil.rmtree(self.path, ignore_errors=True)
                remove_empty_dirs(self.made)  # an empty run.out_dir of its own too; one with files stays
            else:
                for entry in self.path.iterdir():
                    if entry.is_dir():
                        shutil.rmtree(entry, ignore_errors=True)
                    elif entry.name not in (*kept, ".lock"):
                        entry.unlink(missing_ok=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def finished_a_step(path: Path) -> bool:
    """A run directory with a step's metrics or a checkpoint: something a resume continues."""
    metrics = path / "metrics.jsonl"
    return (metrics.is_file() and metrics.stat().st_size > 0) or (path / "checkpoints").exists()


def resume_note(run_dir: Path) -> str:
    """What a stopped run leaves to resume (checkpoints are written atomically)."""
    if has_checkpoint(Path(run_dir)):
        return f"the last checkpoint in {run_dir}/checkpoints stays valid (tailtamer train --resume {run_dir})"
    return "no checkpoint was written yet, so there is nothing to resume"


def has_checkpoint(path: Path) -> bool:
    return (path / "checkpoints" / "latest").is_file()


def unstarted_run(path: Path) -> bool:
    """A run killed in its first step: it holds nothing a new run under its name would lose."""
    names = {p.name for p in path.iterdir()}
    if "config.yaml" not in names or not names <= STARTED_FILES or finished_a_step(path):
        return False
    try:
        return yaml.safe_load((path / "config.yaml").read_text())["run"]["name"] == path.name
    except (OSError, UnicodeDecodeError, yaml.YAMLError, TypeError, KeyError):
        return False


def kept_logs(path: Path) -> list[str]:
    """The logs a run that failed before its first step left in `path` (beside its `.lock`,
    nothing else), or []."""
    names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    return sorted(names - {".lock"}) if {".lock"} < names <= {".lock", *FAILURE_LOGS} else []


def _holds_a_run(path: Path) -> bool:
    """The directory holds a run that finished a step, or files of something else: either way
    not ours to write into."""
    names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    # empty, or left by a run that failed at once (without a .lock, a file of that name is the user's)
    if names <= {".lock"} or kept_logs(path):
        return False
    return not unstarted_run(path)


def _taken(path: Path) -> str:
    if has_checkpoint(path):
        return f"{path} already holds a run; continue it with `tailtamer train --resume {path}`, or give another run.name"
    if finished_a_step(path):
        return f"{path} holds a run with no checkpoint to resume from; give another run.name"
    return f"{path} is a directory of other files, not a run; give another run.name or run.out_dir"


def claim_run_dir(cfg, resume: Path | None):
    """(cfg with run.name resolved, RunDirLock) for a fresh run or a resume; a ConfigError
    naming `--resume` and `run.name` when the directory belongs to another run, and the path
    when the file system refuses it (a name too long, a directory without permission)."""
    try:
        return _claim(cfg, resume)
    except OSError as e:
        where = f"--resume {resume}" if resume is not None else f"run.out_dir={cfg.run.out_dir} run.name={cfg.run.name}"
        path = f" {e.filename}" if e.filename else ""
        raise ConfigError(f"cannot claim the run directory{path} ({e.strerror or e}; {where})") from None


def _claim(cfg, resume: Path | None):
    if resume is not None:
        if not resume.is_dir():
            raise ConfigError(f"--resume {resume}: no such run directory")
        lock = RunDirLock(resume, created=False)
        lock.acquire()
        return cfg, lock
    out = Path(cfg.run.out_dir)
    name = cfg.run.name
    candidates = [name] if name else [DEFAULT_NAME] + [f"{DEFAULT_NAME}-{i}" for i in range(2, 10_000)]
    for candidate in candidates:
        path = out / candidate
        if name and (path.is_symlink() or path.exists()) and not path.is_dir():
            raise ConfigError(f"run.name {name}: {path} is a file, not a run directory; give another run.name")
        if _holds_a_run(path):
            if name:
                raise ConfigError(_taken(path))
            continue
        try:
            made = make_dirs(path)
        except OSError as e:
            raise ConfigError(f"run.out_dir: cannot create {path} ({e.strerror or e})") from None
        lock = RunDirLock(path, created=not any(path.iterdir()), made=made)
        try:
            lock.acquire()
        except RunDirBusy:  # a run in its first step: without a name, take the next one
            if name:
                raise
            continue
        try:
            if _holds_a_run(path):  # another run claimed it between our check and the lock
                lock.release()
                if name:
                    raise ConfigError(f"{path} already holds a run; give another run.name")
                continue
            for stale in (*FAILURE_LOGS, "wandb-id"):  # of a run that ended in its first step: not this one's
                (path / stale).unlink(missing_ok=True)
            lock.created = lock.created or not any(p.name != ".lock" for p in path.iterdir())
        except OSError:  # claimed, then refused by the file system: leave nothing behind
            lock.release(remove_if_unused=True)
            raise
        return replace(cfg, run=replace(cfg.run, name=candidate)), lock
    raise ConfigError(f"run.out_dir {out}: no free run name left")


# What a run keeps in its directory: files, and directories (the drafter's newest checkpoint,
# the loggers' own). Something else at one of these names stops a resume before it writes.
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "resumes.jsonl", "summary.json", REWARD_LOG, VLLM_LOG,
             "wandb-id", "curves.png", "timeline.png", "drafter.png")
RUN_DIRS = ("checkpoints", "drafter", "tensorboard", "wandb")


def check_run_files(run_dir: Path) -> None:
    """A run directory to resume holds its files as files and its directories as directories
    (or not at all): a directory where metrics.jsonl belongs, say, is refused in one line before
    the resume writes anything, rather than failing after it has rewritten config.yaml."""
    for names, kind, ok in ((RUN_FILES, "a file", Path.is_file), (RUN_DIRS, "a directory", Path.is_dir)):
        for name in names:
            path = run_dir / name
            if (path.exists() or path.is_symlink()) and not ok(path):
                what = ("a broken symlink" if not path.exists() else "a directory" if path.is_dir() else
                        "a file" if path.is_file() else "not " + kind)
                raise ConfigError(f"--resume {run_dir}: {name} is {what}, where the run keeps {kind}; move it away "
                                  f"to resume")


# Settings a resumed run cannot change: where it lives and what it started from.
FIXED_ON_RESUME = ("run.name", "run.out_dir", "run.model")


# Settings that instruct one resume, not the run: config.yaml keeps them as these, so that a
# later resume does not repeat them (a fresh draft history would throw a good one away).
ONE_RESUME_ONLY = {("spec", "history_on_resume"): "load"}


def run_settings(cfg_dict: dict) -> dict:
    """What config.yaml keeps of a run's config: all of it, but ONE_RESUME_ONLY as given there."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in cfg_dict.items()}
    for (section, name), value in ONE_RESUME_ONLY.items():
        if isinstance(out.get(section), dict) and name in out[section]:
            out[section][name] = value
    return out


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: dict, now: dict) -> dict:
    """{dotted field: [saved value, new value]} for every field that differs."""
    a, b = flatten(saved), flatten(now)
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def resume_changes(run_dir: Path, cfg_dict: dict) -> dict:
    """What a resume changes against the run's `config.yaml`; a ConfigError if it would change
    one of FIXED_ON_RESUME."""
    path = run_dir / "config.yaml"
    saved = yaml.safe_load(path.read_text()) if path.is_file() else {}
    changes = config_changes(absolute_paths(saved or {}), cfg_dict)
    fixed = [k for k in changes if k in FIXED_ON_RESUME]
    if fixed:
        raise ConfigError(f"--resume {run_dir}: {', '.join(fixed)} cannot change when a run is resumed "
                          f"(it is {changes[fixed[0]][0]!r}); start a new run instead")
    if "spec.drafter" in changes and any((run_dir / "checkpoints").glob("step-*/drafter")):
        raise ConfigError(f"--resume {run_dir}: spec.drafter cannot change: the run's drafter is trained on and kept "
                          f"in its checkpoints (checkpoints/step-N/drafter), and the resume goes on with it; start a "
                          f"new run to draft with another")
    return changes


def record_resume(run_dir: Path, step: int, cfg_dict: dict, changes: dict, log) -> None:
    """Log what a resume changed, append it to `resumes.jsonl` and make `config.yaml` the
    config the run goes on with."""
    if not changes:
        return
    log(f"resuming at step {step} with changed settings: "
        + ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items()))
    with open(run_dir / "resumes.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "changes": changes}) + "\n")
    atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(run_settings(cfg_dict), sort_keys=False))


def keep_metrics_through(path: Path, step: int, log) -> list[dict]:
    """On resume, drop rows (of metrics.jsonl or samples.jsonl) the interrupted run logged
    after its last checkpoint (that of step `step`, counted from 1 as rows are), and lines a kill left torn (a row is written in one piece, so
    only the last line can be)."""
    if not path.is_file():
        return []
    rows, torn = [], []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            torn.append(number)
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    if rows and rows[0]["step"] == 0:  # written before steps counted from 1: renumber
        rows = [{**r, "step": r["step"] + 1} for r in rows]
    rows = [r for r in rows if r["step"] <= step]
    if torn == [len(lines)]:
        log(f"{path}: dropped its last line, unreadable (a run killed while writing leaves one)")
    elif torn:  # not tailtamer's doing: a row is written in one piece
        log(f"{path}: dropped unreadable line{'s' * (len(torn) > 1)} {', '.join(map(str, torn))} (edited by hand?)")
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows
