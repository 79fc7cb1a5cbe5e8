"""Writes that fail: metrics.jsonl and samples.jsonl rows are whole or absent, a logger's failure
never costs the run, and a checkpoint's failed write names its cause."""

import errno
import json
import subprocess
import sys
import textwrap

import pytest

from tailtamer import metrics
from tailtamer.errors import ConfigError
from tailtamer.metrics import Rows, RunLog


class _Full:
    """A file on a disk that fills up halfway through the next write."""

    def __init__(self, real):
        self.real = real

    def seek(self, *args):
        return self.real.seek(*args)

    def write(self, data):
        self.real.write(bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    def truncate(self, size):
        return self.real.truncate(size)

    def close(self):
        self.real.close()


def test_a_row_the_disk_cannot_take_is_cut_back_off(tmp_path):
    """A full disk left metrics.jsonl ending in half a row (and closing the file raised again)."""
    rows = Rows(tmp_path / "metrics.jsonl")
    rows.append([{"step": 1}])
    rows.file = _Full(rows.file)
    with pytest.raises(OSError, match="No space left"):
        rows.append([{"step": 2, "reward": 0.5}])
    rows.close()  # nothing buffered: closing writes nothing
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


ROW = {"step": 1, "reward_mean": 0.0, "accuracy": 0.0, "response_len_p50": 1, "response_len_max": 1, "rollout_s": 0.1,
       "train_s": 0.1, "step_s": 0.2}


class _Logger:
    fail = ""  # which call raises: init, log or close
    rows: list = []

    def __init__(self, run_dir, cfg_dict, first_step):
        if self.fail == "init":
            raise RuntimeError("api_key not configured (no-tty)")

    def log(self, row):
        if self.fail == "log" and row["step"] == 2:
            raise ConnectionError("lost")
        self.rows.append(row["step"])

    def log_samples(self, step, samples):
        pass

    def close(self):
        if self.fail == "close":
            raise RuntimeError("finish failed")
        type(self).closed = True


@pytest.mark.parametrize("fail", ["init", "log", "close"])
def test_a_logger_that_fails_stops_the_run_only_before_it_starts(tmp_path, monkeypatch, fail):
    """W&B's errors reached the user as tracebacks: not logged in at the start, a lost
    connection mid-run (the run died), a failing finish (no summary.json or plots)."""
    monkeypatch.setitem(metrics.LOGGERS, "fake", (_Logger, "json"))
    monkeypatch.setattr(_Logger, "fail", fail)
    monkeypatch.setattr(_Logger, "rows", [])
    monkeypatch.setattr(_Logger, "closed", False, raising=False)
    lines = []
    if fail == "init":
        with pytest.raises(ConfigError, match=r"^run.loggers: fake did not start \(RuntimeError: api_key not "
                                              r"configured \(no-tty\)\); fix it, or leave fake out of run.loggers$"):
            RunLog(tmp_path, ("fake",), {}, 3, 0, lines.append)
        return
    log = RunLog(tmp_path, ("fake",), {}, 3, 0, lines.append)
    for step in (1, 2, 3):
        log.log({**ROW, "step": step})
    log.close()
    notices = [line for line in lines if line.startswith("run.loggers: fake failed")]
    rest = "its own record may be incomplete" if fail == "close" else "dropped for the rest of the run"
    assert len(notices) == 1 and rest in notices[0]
    assert _Logger.rows == ([1] if fail == "log" else [1, 2, 3])
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert _Logger.closed == (fail != "close")  # a logger dropped mid-run is closed too


def test_a_logger_named_twice_logs_once(tmp_path, monkeypatch):
    """An older run's config.yaml may name one twice: it wrote every point twice."""
    monkeypatch.setitem(metrics.LOGGERS, "fake", (_Logger, "json"))
    monkeypatch.setattr(_Logger, "rows", [])
    log = RunLog(tmp_path, ("fake", "fake"), {}, 1, 0, [].append)
    log.log(ROW)
    log.close()
    assert _Logger.rows == [1]


def test_a_file_size_limit_is_named_as_the_disk_error_it_is(tmp_path):
    """Under a per-file size limit (`ulimit -f`, a quota) torch.save failed with "unexpected
    pos", a traceback: the probe of the disk wrote 1 MiB elsewhere, which fit."""
    script = textwrap.dedent(f"""
        import resource, torch
        from pathlib import Path
        from tailtamer.atomic import write_dir
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            write_dir(Path({str(tmp_path / "ckpt")!r}), lambda tmp: torch.save(torch.zeros(1 << 19), tmp / "o.pt"))
        except OSError as e:
            print("errno", e.errno)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == f"errno {errno.EFBIG}", out.stdout + out.stderr
    assert [p.name for p in tmp_path.iterdir()] == []  # the partial checkpoint is gone


def test_what_a_killed_write_left_is_removed_by_the_next_one(tmp_path):
    """A write killed by SIGKILL (the OOM killer) runs no handler: its hidden temporary stayed
    for good (1.4 GB for a 0.5B model). The next write of the same path removes it; one of a
    live writer, of another host or of another file stays."""
    import os
    import signal

    from tailtamer.atomic import _pid_space, atomic_write, write_dir

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.send_signal(signal.SIGKILL)
    child.wait()
    here = _pid_space()
    dead, live = f"{child.pid}@{here}", f"{os.getppid()}@{here}"
    left = [f".model.safetensors.{dead}.abcd_123.tmp", f".step-000010.{dead}.x1y2z3w4"]
    kept = [f".model.safetensors.{live}.abcd_123.tmp", f".model.safetensors.{child.pid}@other-host.1.abcd_123.tmp",
            f".model.safetensors.{child.pid}@{here}7.abcd_123.tmp",  # another container's PID namespace
            f".model.safetensors.{10 ** 12}@{here}.abcd_123.tmp",  # no PID at all: was an OverflowError
            f".model.safetensors.json.{dead}.abcd_123.tmp", ".model.safetensors.k3j2_x1a.tmp"]
    for name in left[:1] + kept:
        (tmp_path / name).write_text("partial")
    (tmp_path / left[1]).mkdir()
    (tmp_path / left[1] / "model.safetensors").write_text("partial")
    atomic_write(tmp_path / "model.safetensors", lambda tmp: open(tmp, "w").write("whole"))
    write_dir(tmp_path / "step-000010", lambda tmp: (tmp / "state.json").write_text("{}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "model.safetensors", "step-000010"])
    assert (tmp_path / "model.safetensors").read_text() == "whole"


def test_a_finished_run_whose_summary_cannot_be_written_says_what_is_complete(toy, tmp_path, monkeypatch):
    """It said how to resume a run that had nothing left to resume."""
    from tailtamer.config import load_train_config
    from tailtamer.errors import WriteError
    from tailtamer.rl import trainer

    def full_disk(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "atomic_write_json", full_disk)
    with pytest.raises(WriteError) as e:
        trainer.train(load_train_config(None, toy + ["run.name=done", "run.steps=2"]), log=lambda *a: None)
    assert str(e.value).endswith("(No space left on device); the run finished: its checkpoint of step 2 and "
                                 "metrics.jsonl are complete"), e.value
    assert "--resume" not in str(e.value)
    assert (tmp_path / "runs" / "done" / "checkpoints" / "step-000002" / "state.json").is_file()


def test_a_stop_during_a_write_on_a_full_disk_stays_a_stop(tmp_path, monkeypatch):
    """The disk probe that names a library's failed write ran on a stop raised inside the write
    too; on a full disk the probe's OSError replaced the stop: a traceback, exit 1."""
    from tailtamer import atomic
    from tailtamer.atomic import write_dir
    from tailtamer.stopping import Interrupted

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.tempfile, "TemporaryFile", full)  # the probe's own write

    def stopped(tmp):
        (tmp / "part").write_text("x")
        raise Interrupted("stopped by Ctrl-C after step 3", "Ctrl-C")

    with pytest.raises(Interrupted, match="stopped by Ctrl-C after step 3"):
        write_dir(tmp_path / "m", stopped)
    assert list(tmp_path.iterdir()) == []
