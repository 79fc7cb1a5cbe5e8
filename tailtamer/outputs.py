"""Where a command writes: an output file or directory is checked before any work, so a
mistake is one line and nothing of the user's is replaced; the directories the checks create
are removed again (if still empty) when the command fails."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tailtamer.atomic import make_dirs
from tailtamer.errors import TailtamerError
from tailtamer.rl.run_dir import FAILURE_LOGS, RUN_DIRS, RUN_FILES

# Directories the output checks created, removed again (if still empty) when the command
# fails (the command's main): a mistyped option must not leave an empty --out behind.
CREATED: list[Path] = []


def _writable_dir(directory: Path, flag: str, path: str) -> None:
    """Create `directory` if needed and prove a file can be written there (as root, mode bits
    say nothing, so try it)."""
    if any(parent.is_file() for parent in [directory, *directory.parents]):
        raise TailtamerError(f"{flag} {path}: a parent of it is a file")
    try:
        CREATED.extend(make_dirs(directory))
    except OSError as e:  # named by the directory that refused it, an existing parent
        refused = next((d for d in directory.parents if d.exists()), directory)
        raise TailtamerError(f"{flag} {path}: cannot create a directory in {refused} ({e.strerror or e})") from None
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise TailtamerError(f"{flag} {path}: cannot create a file in {directory} ({e.strerror or e})") from None


def output_file(path: str, flag: str, inputs: dict[str, str] = {}) -> None:
    """An output file must be writable where it is asked for and must not be one of the
    command's inputs (or lie inside an input directory), checked before any work."""
    if not path:
        raise TailtamerError(f"{flag} is empty; give a file path")
    p = Path(path)
    if p.is_dir():
        raise TailtamerError(f"{flag} {path} is a directory; give a file path")
    if p.exists() and not p.is_file():  # the write replaces the path: a device or pipe would be gone
        raise TailtamerError(f"{flag} {path} is not a regular file (a device, pipe or socket); give a file path")
    if path.endswith(("/", os.sep)):
        raise TailtamerError(f"{flag} {path} ends with a '/', as a directory does; give a file path")
    _clear_of_inputs(p, flag, path, inputs, "would overwrite")
    owner = owned_by(p.resolve())
    if owner:
        raise TailtamerError(f"{flag} {path} would replace {owner}; give a path outside it")
    _writable_dir(p.parent, flag, path)


# A model's or drafter's own files (Hugging Face's layout), which an output never replaces.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def owned_by(path: Path) -> str | None:
    """What owns `path`, an existing file or one to be written, when an output must not be
    there: a model or drafter directory (config.json beside safetensors weights) or a training
    run (config.yaml beside metrics.jsonl), for the files each keeps or will write (a run's
    checkpoints, drafter and loggers' directories included); None for any other file, which an
    output replaces as asked (a command run again into the same --out, a file of the user's
    beside a run)."""
    model = path.parent
    if (path.name in MODEL_FILES or path.suffix == ".safetensors") and (model / "config.json").is_file() \
            and any(model.glob("*.safetensors")):
        return f"a file of the model or drafter {model}"
    run = run_holding(path)
    return None if run is None else f"a file of the training run {run}"


def run_holding(path: Path) -> Path | None:
    """The training run directory whose own files (`RUN_FILES`, `RUN_DIRS`) hold `path` (a
    checkpoint, its metrics, or where the run would write them: a path that does not exist yet
    counts where the directory also holds the run's `.lock`, so that a project's folder with a
    config.yaml and a metrics.jsonl of its own is no run; and the logs a run that failed before
    its first step keeps beside its `.lock`, `FAILURE_LOGS`), or None; relative to the working
    directory when `path` is given so."""
    real = Path(os.path.realpath(path))  # `..` and links resolved, as the file system reads them
    exists = path.exists()
    for directory in real.parents:
        own, lock = real.relative_to(directory).parts[0], (directory / ".lock").is_file()
        started = (directory / "config.yaml").is_file() and (directory / "metrics.jsonl").exists()
        if (started and (exists or lock) and own in (*RUN_FILES, *RUN_DIRS)) or (lock and exists and own in FAILURE_LOGS):
            return directory if path.is_absolute() else Path(os.path.relpath(directory))
    return None


def _clear_of_inputs(p: Path, flag: str, path: str, inputs: dict[str, str], clash: str) -> None:
    """An output path is none of `inputs` and lies inside none of them."""
    for other_flag, other in inputs.items():
        o = Path(other).resolve()
        if p.resolve() == o or o in p.resolve().parents:
            raise TailtamerError(f"{flag} {path} {clash} {other_flag} {other}")


def fresh_output_dir(path: str, flag: str, ours: tuple[str, ...] = (), inputs: dict[str, str] = {}) -> None:
    """A directory a command writes into: never over a file or another directory's content
    (files named in `ours`, the command's own earlier output, excepted), nor into `inputs`."""
    if not path:
        raise TailtamerError(f"{flag} is empty; give a directory to create")
    p = Path(path)
    _clear_of_inputs(p, flag, path, inputs, "would write into")
    run = run_holding(p)
    if run is not None:
        raise TailtamerError(f"{flag} {path} is where the training run {run} keeps its own files; give a directory "
                             f"outside them")
    if p.exists() and not p.is_dir():
        raise TailtamerError(f"{flag} {path} is {'a file' if p.is_file() else 'not a directory'}; give a directory "
                             f"to create")
    other = p.is_dir() and sorted(child.name for child in p.iterdir() if child.name not in ours)
    if other:
        what = f"{other[0]}" + (f" and {len(other) - 1} more" if len(other) > 1 else "")
        raise TailtamerError(f"{flag} {path} already exists and holds {what}; give a new directory")
    _writable_dir(p, flag, path)
