"""Atomic writes of files and directories: a crash mid-write leaves what was there before,
never a torn file or a half-filled directory."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from tailtamer.errors import TailtamerError, WriteError


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)`, fsync it, then rename it over `path` (same directory, so atomic).
    A symlink is followed: its target is replaced, the link stays."""
    path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(path)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        # after the write: mkstemp's 0600 (which safetensors' writer keeps, replacing the file)
        # would make results unreadable to others
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        cause = _disk_error(e, path.parent, Path(tmp))  # while the partial file still takes its space
        if os.path.exists(tmp):
            os.unlink(tmp)
        if cause is not None:
            raise cause from e
        raise


PROBE_BYTES = 1 << 20


def _disk_error(e: BaseException, directory: Path, partial: Path | None = None) -> OSError | None:
    """The OSError behind a library's failed write that is no OSError: safetensors names its
    errno ("... (os error 28)"), torch.save only says its stream failed, so then one more byte
    appended to what was written (`partial`, a file or the largest file of a directory: a
    per-file size limit, EFBIG, stops only the file at it) and a write of PROBE_BYTES into the
    same directory say whether the disk takes any more. None: `e` is an OSError already, or not
    about the disk."""
    if isinstance(e, (OSError, TailtamerError)) or not isinstance(e, Exception):  # ours say what they are
        return None
    found = re.search(r"\(os error (\d+)\)", str(e))
    if found:
        return OSError(int(found[1]), os.strerror(int(found[1])))
    files = []
    if partial is not None and partial.is_file():
        files = [partial]
    elif partial is not None and partial.is_dir():
        files = [f for f in partial.rglob("*") if f.is_file()]
    if files:
        try:
            with open(max(files, key=lambda f: f.stat().st_size), "ab") as f:
                f.write(b"\0")
                f.flush()
        except OSError as probe:
            return probe
    try:
        with tempfile.TemporaryFile(dir=directory) as f:
            f.write(bytes(PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as probe:
        return probe
    return None


@contextmanager
def writing(what: str, where, left: str = ""):
    """A write in the block that fails (a full disk, a read-only directory) becomes one
    WriteError naming what was being written and where; `left` says what is left (the writes
    are atomic: everything written before is intact)."""
    try:
        yield
    except OSError as e:
        raise WriteError(f"cannot write {what} into {where} ({e.strerror or e}){left}") from None


@functools.cache  # a process keeps both, forked children too: read once, not at every write
def _pid_space() -> str:
    """Where this process's PID means this process: the host and its PID namespace (containers
    of one pod share a host name and a volume, each with PIDs of its own)."""
    try:
        space = re.sub(r"\D", "", os.readlink("/proc/self/ns/pid"))
    except OSError:
        space = "0"
    return f"{socket.gethostname()}.{space}"


def _temp_prefix(final: Path) -> str:
    """A hidden temporary sibling's name starts with its writer's PID and PID space, so that a
    later write of the same path can tell one a killed writer left (SIGKILL, the OOM killer: no
    handler runs) from one being written."""
    return f".{final.name}.{os.getpid()}@{_pid_space()}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process; a number no PID is: not ours to judge
        return True
    return True


def remove_abandoned(final: Path) -> None:
    """Remove the hidden temporary siblings of `final` (`_temp_prefix`) whose writer was in
    this PID space and is gone: a checkpoint or model killed mid-write otherwise keeps its size
    on disk for good, hidden. Another host's or container's (a shared file system) and a live
    writer's stay."""
    start, space = f".{final.name}.", _pid_space()
    try:
        entries = [e for e in os.scandir(final.parent) if e.name.startswith(start)]
    except OSError:
        return
    for entry in entries:
        # mkstemp's and mkdtemp's names end in 8 random characters
        writer = re.fullmatch(rf"(\d+)@{re.escape(space)}\.[a-z0-9_]{{8}}(\.tmp)?", entry.name[len(start):])
        if writer is None or _alive(int(writer[1])):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:  # another process removed it first, or may not: the write goes on
            pass


def temp_dir(final: Path) -> Path:
    """A fresh hidden sibling directory of `final`, to write into and rename into place, with
    the permissions a new directory gets (mkdtemp's 0700 would hide checkpoints from others)."""
    remove_abandoned(final)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(final), dir=final.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def make_dirs(path: Path) -> list[Path]:
    """`path.mkdir(parents=True, exist_ok=True)`, returning the directories it created, for
    `remove_empty_dirs` when what needed them fails."""
    created = [d for d in [path, *path.parents] if not d.exists()]
    path.mkdir(parents=True, exist_ok=True)
    return created


def remove_empty_dirs(directories) -> None:
    """Remove those of `directories` that are empty, deepest first (a parent empties as its
    children go); one that holds anything stays."""
    for directory in sorted(directories, key=lambda d: len(Path(os.path.abspath(d)).parts), reverse=True):
        try:
            directory.rmdir()
        except OSError:
            pass


def write_dir(final: Path, write: Callable[[Path], None], existing: str = "empty") -> bool:
    """Fill a directory with `write(tmp)` in a hidden sibling and rename it to `final`, so an
    error or an interrupt leaves `final` as it was. `existing`, for a `final` already there:
    "empty" (only an empty directory is replaced, as a command's fresh --out), "replace" (a
    checkpoint written again), "keep" (another process wrote it first: this one's is dropped,
    and the result is False)."""
    final = Path(os.path.abspath(final))  # `--out .` too has a parent to write the sibling in
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(final)
    try:
        write(tmp)
        if final.exists() and existing == "keep":
            shutil.rmtree(tmp)
            return False
        if final.exists() and existing == "replace":
            shutil.rmtree(final)
        os.rename(tmp, final)  # onto an empty directory too; a non-empty one is an OSError
    except BaseException as e:
        cause = _disk_error(e, final.parent, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if cause is not None:
            raise cause from e
        raise
    return True


def _umask() -> int:
    """The process's umask, read without setting it where Linux shows it: setting it, even for
    an instant, would apply to files other threads create then (the checkpoint thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")
