"""A run never destroys another run's files, stops cleanly when asked, says what it saved, and
survives the files a crash leaves behind: run-directory claims and locks, Ctrl-C, failing disks
and failing rewards (resuming a run: test_resume.py)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tailtamer.config import load_train_config
from tailtamer.errors import CheckpointError, ConfigError, DataError
from tailtamer.rl.trainer import TrainingError, launch, train
from conftest import write_jsonl
from test_trainer import _comparable, _rows


def quiet(*_args) -> None:
    pass


def _train(toy, *extra, resume=None, log=quiet):
    if resume is not None:
        return train(load_train_config(resume / "config.yaml", list(extra)), resume=resume, log=log)
    return train(load_train_config(None, toy + list(extra)), log=log)


def test_a_run_name_belongs_to_one_run(toy, tmp_path):
    _train(toy, "run.steps=2", "run.name=mine")
    before = (tmp_path / "runs" / "mine" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"runs/mine already holds a run.*--resume .*runs/mine.*run.name"):
        _train(toy, "run.steps=3", "run.name=mine")
    assert (tmp_path / "runs" / "mine" / "metrics.jsonl").read_text() == before  # untouched


def test_a_run_name_the_file_system_refuses_is_one_line(toy, tmp_path):
    """A name longer than a file name may be raised OSError (ENAMETOOLONG) from the claim's
    checks, a traceback, once run.out_dir existed."""
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match=r"^cannot claim the run directory .*x{256} \(File name too long; "
                                          r"run.out_dir=.*runs run.name=x{256}\)$"):
        _train(toy, "run.steps=1", "run.name=" + "x" * 256)
    (tmp_path / "runs" / "notes").write_text("mine\n")
    (tmp_path / "runs" / "gone").symlink_to(tmp_path / "nowhere")
    for name in ("notes", "gone"):  # blamed on run.out_dir ("cannot create ... (File exists)")
        with pytest.raises(ConfigError, match=rf"^run.name {name}: .*runs/{name} is a file, not a run directory"):
            _train(toy, "run.steps=1", f"run.name={name}")
    assert (tmp_path / "runs" / "notes").read_text() == "mine\n"


def test_a_run_killed_before_its_first_step_gives_its_name_back(toy, tmp_path):
    """SIGTERM or SIGKILL in step 1 leaves the config (naming the run) and an empty metrics
    file, no checkpoint: a resume says to start anew, and the same name then starts over in
    that directory. A directory of other files, a config.yaml among them, is no run, and
    nothing is written into it."""
    from tailtamer.config import to_dict

    run = tmp_path / "runs" / "cut"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(load_train_config(None, toy + ["run.name=cut"]))))
    (run / "metrics.jsonl").write_text("")
    (run / "reward.log").write_text("what the reward printed\n")
    (run / "wandb-id").write_text("1a2b3c4d\n")
    with pytest.raises(CheckpointError, match=r"no checkpoint to resume from .*stopped in its first step: start it "
                                              r"anew with `tailtamer train .*runs/cut/config.yaml`"):
        _train(toy, "run.steps=1", resume=run)
    _train(toy, "run.steps=1", "run.name=cut")
    assert len(_rows(run)) == 1
    assert not (run / "wandb-id").exists() and (run / "reward.log").read_text() == ""  # the killed run's, gone
    for name, files in (("data", {"mine.jsonl": "{}\n"}), ("proj", {"config.yaml": "run: {name: proj}\n",
                                                                      "notes.txt": "mine"})):
        other = tmp_path / "runs" / name
        other.mkdir()
        for file, text in files.items():
            (other / file).write_text(text)
        with pytest.raises(ConfigError, match=rf"runs/{name} is a directory of other files, not a run"):
            _train(toy, "run.steps=1", f"run.name={name}")
        assert {p.name: p.read_text() for p in other.iterdir()} == files
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # a step done, but no checkpoint (SIGKILL before it)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    with pytest.raises(ConfigError, match=r"runs/cut holds a run with no checkpoint to resume from; give another"):
        _train(toy, "run.steps=1", "run.name=cut")


def test_a_run_that_fails_at_start_up_leaves_no_empty_out_dir(toy, tmp_path):
    """run.out_dir the claim created goes with the run directory; one with files stays."""
    from tailtamer.rl.trainer import launch

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    for out in (tmp_path / "new" / "runs", tmp_path / "mine"):
        with pytest.raises(DataError, match="row has neither 'prompt' nor 'messages'"):
            launch(load_train_config(None, toy + [f"data.train={bad}", f"run.out_dir={out}", "run.workers=1"]))
        (tmp_path / "mine").mkdir(exist_ok=True)
        (tmp_path / "mine" / "notes.txt").write_text("kept")
    assert not (tmp_path / "new").exists()
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_without_a_name_a_run_passes_over_one_in_its_first_step(toy, tmp_path):
    """A run still in its first step holds its directory's lock and only its config: a run
    without a name takes the next free name instead of failing on the lock."""
    from tailtamer.config import to_dict

    busy = tmp_path / "runs" / "default"
    busy.mkdir(parents=True)
    (busy / "config.yaml").write_text(yaml.safe_dump(to_dict(load_train_config(None, toy + ["run.name=default"]))))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, time\n"
        f"fd = os.open({str(busy / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)")], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"locked"
        assert _train(toy, "run.steps=1")["run_dir"].endswith("/default-2")
        with pytest.raises(ConfigError, match=r"runs/default is in use by another tailtamer run"):
            _train(toy, "run.steps=1", "run.name=default")
    finally:
        holder.kill()
        holder.wait()


def test_checkpoints_have_the_permissions_the_umask_gives(toy, tmp_path):
    """Not the 0700 / 0600 of temporary files (and of safetensors' writer), which would hide a
    run's checkpoints from the other users of a shared machine."""
    import stat

    old = os.umask(0o022)
    try:
        _train(toy, "run.steps=1", "run.name=shared", "run.save_every=1")
    finally:
        os.umask(old)
    checkpoint = tmp_path / "runs" / "shared" / "checkpoints" / "step-000001"
    assert stat.S_IMODE(checkpoint.stat().st_mode) == 0o755
    files = [p for p in checkpoint.rglob("*") if p.is_file()]
    assert "model.safetensors" in {p.name for p in files}
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: 0o644 for p in files}


def test_without_a_name_a_run_takes_the_next_free_one(toy, tmp_path):
    first = _train(toy, "run.steps=1")
    second = _train(toy, "run.steps=1")
    assert first["run_dir"].endswith("/default") and second["run_dir"].endswith("/default-2")
    assert yaml.safe_load((tmp_path / "runs" / "default-2" / "config.yaml").read_text())["run"]["name"] == "default-2"


def test_a_locked_run_directory_is_refused(toy, tmp_path):
    """A run that is still going holds its directory's lock: a resume of it is refused."""
    _train(toy, "run.steps=2", "run.name=busy", "run.save_every=1")
    run = tmp_path / "runs" / "busy"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(run / '.lock')!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nos.pwrite(fd, b'4242\\n', 0)\nprint('locked', flush=True)\ntime.sleep(60)")],
        stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"locked"
        with pytest.raises(ConfigError, match=r"in use by another tailtamer run \(pid 4242\)"):
            _train(toy, "run.steps=3", resume=run)
    finally:
        holder.kill()
        holder.wait()
    _train(toy, "run.steps=3", resume=run)  # the lock died with its holder
    assert len(_rows(run)) == 3


def test_a_failed_checkpoint_write_stops_the_run_and_keeps_the_last_good_one(toy, tmp_path, monkeypatch):
    import errno

    import tailtamer.rl.checkpoint as checkpoint

    real, calls = checkpoint.save_model, []

    def full_disk(model, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(model, path)

    monkeypatch.setattr(checkpoint, "save_model", full_disk)
    with pytest.raises(TrainingError, match=r"cannot write the checkpoint of step 2.*No space left.*last checkpoint "
                                            r"is step 1 \(resume with `tailtamer train --resume"):
        _train(toy, "run.steps=3", "run.name=full", "run.save_every=1")
    run = tmp_path / "runs" / "full"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000001"
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")] == []  # no partial one
    monkeypatch.setattr(checkpoint, "save_model", real)
    _train(toy, "run.steps=3", resume=run)
    assert [r["step"] for r in _rows(run)] == [1, 2, 3]


def _safetensors_full(real):
    """safetensors' save_file on a full disk: its own error, no OSError, the errno in its text."""
    from safetensors import SafetensorError

    calls = []

    def save_file(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) > 1:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        real(tensors, path, metadata=metadata)
    return save_file


@pytest.mark.parametrize("library", ["safetensors", "torch.save"])
def test_a_full_disk_as_the_libraries_report_it_is_one_line_and_the_run_resumes(toy, tmp_path, monkeypatch, library):
    """What a full disk raises inside safetensors (SafetensorError) or torch.save (a
    RuntimeError about its stream, and a disk that takes no more) stops the run with one line
    that names what was being written and the last good checkpoint; the run resumes."""
    import errno

    import tailtamer.atomic as atomic
    import tailtamer.model.io as io
    import tailtamer.rl.checkpoint as checkpoint

    if library == "safetensors":
        monkeypatch.setattr(io, "save_file", _safetensors_full(io.save_file))
    else:
        real_save, calls = checkpoint.torch.save, []

        def torch_save(obj, path):
            calls.append(path)
            if len(calls) > 1:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 89472 vs 89360")
            real_save(obj, path)

        def disk_full(*_args, **_kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(checkpoint.torch, "save", torch_save)
        monkeypatch.setattr(atomic.tempfile, "TemporaryFile", disk_full)
    with pytest.raises(TrainingError) as raised:
        _train(toy, "run.steps=4", "run.name=full", "run.save_every=2")
    assert str(raised.value).count("\n") == 0
    assert re.fullmatch(r"cannot write the checkpoint of step 4 into .*checkpoints \(No space left on device\); the "
                        r"run stops here; the last checkpoint is step 2 \(resume with `tailtamer train --resume .*`\)",
                        str(raised.value)), str(raised.value)
    run = tmp_path / "runs" / "full"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # no partial one
    monkeypatch.undo()
    _train(toy, "run.steps=4", resume=run)
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4]


def test_a_library_error_that_is_not_the_disk_stays_what_it_is(tmp_path):
    from tailtamer.atomic import atomic_write

    def broken(_path):
        raise RuntimeError("a bug in the writer")

    with pytest.raises(RuntimeError, match="a bug in the writer"):  # the disk takes more: not a write error
        atomic_write(tmp_path / "x", broken)
    assert list(tmp_path.iterdir()) == []


def test_a_drafter_checkpoint_that_cannot_be_written_is_one_error_in_the_training_thread(tmp_path, monkeypatch,
                                                                                        capsys):
    from tailtamer.drafter import spot
    from tailtamer.drafter.buffer import DataBuffer
    from tailtamer.errors import WriteError
    from tailtamer.model.drafter import init_drafter
    from conftest import random_model

    def full_disk(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spot, "write_drafter", full_disk)
    trainer = spot.SpotTrainer(init_drafter(random_model()), DataBuffer(1 << 20), spot.SpotConfig(), 0)
    trainer.checkpoint_async(tmp_path / "drafter")
    with pytest.raises(WriteError, match=f"^cannot write the drafter into {tmp_path / 'drafter'} \\(No space left"):
        trainer.wait()
    trainer.wait()  # said once
    assert "Traceback" not in capsys.readouterr().err  # nothing from the writer's thread


def test_a_read_only_output_directory_is_a_startup_error(toy, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="run.out_dir: cannot create"):
        _train(toy, f"run.out_dir={blocker}/runs")


REWARDS = '''
import os
def boom(response, answer):
    raise RuntimeError("bad reward")
def half(response, answer):
    if response and ord(response[0]) % 2:
        raise ValueError("odd first character")
    if response.startswith("d"):
        os._exit(1)
    return 1.0
'''


def test_a_run_whose_rewards_all_fail_stops_with_the_message(toy, tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    with pytest.raises(TrainingError, match=r"every reward of step 1 failed \(32 of 32 samples.*RuntimeError: bad reward"):
        _train(toy, f"rl.reward={path}:boom", "run.name=allfail")


def test_a_run_that_fails_later_keeps_its_summary_and_plots(toy, tmp_path):
    """The reward fails on every sample from step 2 on: the run stops with a checkpoint of step
    1, and summary.json (not `finished`) and the plots cover the step it took."""
    path = tmp_path / "late.py"
    path.write_text("calls = 0\ndef late(response, answer):\n    global calls\n    calls += 1\n"
                    "    if calls > 32:\n        raise RuntimeError('late failure')\n    return 1.0\n")
    with pytest.raises(TrainingError, match=r"every reward of step 2 failed.*the last checkpoint is step 1"):
        _train(toy, f"rl.reward={path}:late", "run.name=late", "run.steps=4")
    run = tmp_path / "runs" / "late"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["finished"] is False
    assert (run / "curves.png").is_file() and (run / "timeline.png").is_file()


def test_a_failure_at_the_last_checkpoint_or_in_the_plots_keeps_the_error(toy, tmp_path, monkeypatch):
    """The final checkpoint's write fails: the summary still covers both steps (not finished);
    a plot that fails then too is logged, and the checkpoint's error is the one raised."""
    from tailtamer.rl import trainer

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer, "save_checkpoint", full_disk)
    with pytest.raises(TrainingError, match="cannot write the checkpoint of step 2 .*No space left on device"):
        _train(toy, "run.name=full", "run.steps=2", "run.save_every=0")
    summary = json.loads((tmp_path / "runs" / "full" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["finished"] is False
    monkeypatch.setattr(trainer, "plot_rl_curves", lambda *a: 1 / 0)
    lines = []
    with pytest.raises(TrainingError, match="cannot write the checkpoint of step 2"):
        _train(toy, "run.name=full-plots", "run.steps=2", "run.save_every=0", log=lines.append)
    assert any(line.startswith("no summary or plots written in") and "ZeroDivisionError" in line for line in lines)


def test_reward_failures_are_shown_once_per_kind_and_summarised(toy, tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    lines = []
    summary = _train(toy, f"rl.reward={path}:half", "run.name=some", "run.steps=3", log=lines.append)
    shown = [line for line in lines if line.startswith("reward failure")]
    assert len(shown) == len(summary["reward_failures"]) >= 1
    assert any("ValueError: odd first character" in line for line in shown)
    failures = summary["reward_failures"]
    assert failures["ValueError"]["count"] == summary["reward_errors"] - failures.get("process died", {}).get("count", 0)
    assert json.loads((tmp_path / "runs" / "some" / "summary.json").read_text())["reward_failures"] == failures


def _cli_train(args, cwd):
    return subprocess.Popen([sys.executable, "-m", "tailtamer", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, cwd=cwd, text=True)


def _signal_after_two_steps(proc, run, send) -> str:
    """`send` a signal once the run in `proc` has logged two steps; its stderr once it ends."""
    deadline = time.time() + 120
    # complete lines only: the trainer may be halfway through appending the next one
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
        time.sleep(0.02)
    send()
    return proc.communicate(timeout=120)[1]


@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_stops_after_the_step_with_a_checkpoint(toy, tmp_path, workers):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) ends the step, saves a
    checkpoint, says how to resume, exits 130 without a traceback; the resume then repeats an
    uninterrupted run."""
    common = toy + ["run.save_every=0", "rl.lr=1e-3", f"run.workers={workers}"]
    args = common + ["run.steps=40", "run.name=stopped"]
    run = tmp_path / "runs" / "stopped"
    proc = _cli_train(args, tmp_path)
    err = _signal_after_two_steps(proc, run, lambda: os.killpg(proc.pid, signal.SIGINT))
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    done = len(_rows(run))
    # one line, said once (it read "stopped: stopped by Ctrl-C ...")
    assert err.strip().splitlines()[-1].startswith(f"stopped by Ctrl-C after step {done} of 40; ")
    assert f"tailtamer train --resume {run}" in err
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{done:06d}"
    summary = json.loads((run / "summary.json").read_text())  # of the steps it took
    assert summary["steps"] == done and summary["finished"] is False and (run / "curves.png").is_file()
    launch(load_train_config(run / "config.yaml", ["run.steps=6"]), resume=run, console=quiet)
    launch(load_train_config(None, common + ["run.steps=6", "run.name=straight"]), console=quiet)
    assert _comparable(_rows(run)) == _comparable(_rows(tmp_path / "runs" / "straight"))


def test_ctrl_c_to_the_launcher_alone_stops_its_workers_after_the_step(toy, tmp_path):
    """`kill -INT` to a multi-worker run's launcher (not its process group) went unheard: the
    run went on to its last step. The launcher passes the stop on as SIGTERM, which a worker
    that also gets the terminal's SIGINT counts as the same stop, not a second Ctrl-C."""
    run = tmp_path / "runs" / "int"
    proc = _cli_train(toy + ["run.save_every=0", "run.workers=2", "run.steps=40", "run.name=int"], tmp_path)
    err = _signal_after_two_steps(proc, run, lambda: os.kill(proc.pid, signal.SIGINT))
    assert proc.returncode == 130, err
    done = len(_rows(run))
    # in the launcher's words: the workers were stopped by SIGTERM, the user pressed Ctrl-C
    assert done < 40 and f"stopped by Ctrl-C after step {done} of 40" in err and "SIGTERM" not in err
    assert f"tailtamer train --resume {run}" in err
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{done:06d}"


@pytest.mark.parametrize("workers,to", [(1, "process"), (2, "launcher"), (2, "group")])
def test_sigterm_stops_after_the_step_with_a_checkpoint(toy, tmp_path, workers, to):
    """SIGTERM (SLURM, Kubernetes, `docker stop`), to the launcher alone (passed on to the
    workers) or to the whole process group (each worker gets it twice: still one stop), ends
    the step and saves a checkpoint, as a first Ctrl-C does; the reward process ignores it."""
    run = tmp_path / "runs" / "term"
    proc = _cli_train(toy + ["run.save_every=0", f"run.workers={workers}", "run.steps=40", "run.name=term"], tmp_path)
    err = _signal_after_two_steps(proc, run, lambda: (os.killpg if to == "group" else os.kill)(proc.pid, signal.SIGTERM))
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "reward" not in err
    done = len(_rows(run))
    assert f"stopped by SIGTERM after step {done} of 40" in err and f"tailtamer train --resume {run}" in err
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{done:06d}"
    assert json.loads((run / "summary.json").read_text())["finished"] is False


def test_a_stop_during_the_evaluation_before_the_first_step_ends_the_run_at_once(toy, tmp_path):
    """SIGTERM in the start-up evaluation was taken as 'stop after this step': the run went on
    through the evaluation, step 1 and its evaluation (with 100,000 held-out prompts, minutes)."""
    run = tmp_path / "runs" / "ev"
    proc = _cli_train(toy + ["run.name=ev", "run.steps=3", "run.eval_every=1", "data.eval=builtin",
                             "data.n_eval=30000"], tmp_path)
    try:
        deadline = time.time() + 120
        while not (run / "config.yaml").is_file():
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
            time.sleep(0.02)
        time.sleep(1.0)  # into the evaluation (30,000 prompts: a stop that waits for the step takes minutes)
        os.kill(proc.pid, signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:  # never left running on a failure
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err and "after step" not in err, err
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


def test_more_workers_than_prompts_is_a_startup_error(toy, monkeypatch):
    from tailtamer.dist import Workers
    from tailtamer.rl.run_state import setup

    cfg = load_train_config(None, toy + ["run.name=many", "run.workers=5"])
    with pytest.raises(ConfigError, match=r"run.workers: 5 workers but only 4 prompts per step.*set run.workers=4 "
                                          r"or raise rollout.prompts_per_step and add prompts to data.train"):
        setup(cfg, log=quiet, workers=Workers(rank=0, world=5))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun chose the count, not run.workers
    with pytest.raises(ConfigError, match=r"torchrun started 5 workers but only 4 prompts.*start at most 4 processes"):
        setup(cfg, log=quiet, workers=Workers(rank=0, world=5))


def test_an_automatic_worker_count_is_capped_by_the_training_prompts(toy, tmp_path, monkeypatch, capsys):
    """run.workers=0 on a machine with more cores than the data has prompts starts one worker
    per prompt (here one prompt: the run goes on in this process) instead of refusing."""
    from tailtamer.rl import trainer

    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "ab", "answer": "0"}])
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(trainer, "spawn", lambda *a, **k: pytest.fail("spawned workers for one prompt"))
    printed = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))
    summary = trainer.launch(load_train_config(None, toy + ["run.name=one", f"data.train={one}", "run.steps=1",
                                                            "spec.strategy=2_1_3"]), console=quiet)
    assert summary["workers"] == 1 and summary["steps"] == 1
    assert any(line.startswith("run.workers=0: 1 worker rather than one per core, as a step has only 1 prompt to "
                               f"share (rollout.prompts_per_step=4, data.train={one})") for line in printed), printed
    # said once: by the launcher, not again by the worker it became (whose `log` is the print
    # bound at its definition, which writes to the captured stdout)
    said = [line for line in printed + capsys.readouterr().out.splitlines() if "is not read" in line]
    assert said == ["spec.strategy=2_1_3 is not read: spec.mode=off decodes without speculation"], said


def test_more_workers_asked_for_than_prompts_to_share_is_said(toy, monkeypatch, capsys):
    from tailtamer.rl import trainer

    started = []
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(trainer, "spawn", lambda world, *a, **k: started.append(world))
    trainer.launch(load_train_config(None, toy + ["run.workers=8", "run.steps=1"]), console=quiet)
    assert started == [4]
    assert "run.workers=8: 4 workers, as a step has only 4 prompts to share (rollout.prompts_per_step)" in \
        capsys.readouterr().out


def test_files_of_runs_written_before_the_renames_still_resume(tmp_path):
    """An older tailtamer wrote steps from 0 and a `drafter:` section: a resume reads both (the
    rows renumbered, those after the checkpoint dropped); a user's own file gets the hint."""
    import json

    from tailtamer.config import load_train_config
    from tailtamer.rl.run_dir import keep_metrics_through

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in range(3)))
    kept = keep_metrics_through(metrics, 2, log=quiet)  # the checkpoint of step 2 (after rows 0 and 1)
    assert [(r["step"], r["reward_mean"]) for r in kept] == [(1, 0.0), (2, 0.1)]
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2]
    old = tmp_path / "config.yaml"
    old.write_text("drafter:\n  train: false\n  lr: 0.001\n")
    assert load_train_config(old, written=True).spot.lr == 0.001
    with pytest.raises(ConfigError, match="drafter is now spot"):
        load_train_config(old)


def test_a_run_written_with_the_former_default_buckets_resumes_on_todays_arms(tmp_path):
    """Before the fourth bucket a run's config.yaml held spec.bucket_thresholds [1, 3, 65] with
    the default arms (strategies null): read back, they follow today's default arms; the same in
    a user's own file is one line that says what to do; with arms of their own they are kept."""
    from tailtamer.config import load_train_config

    old = tmp_path / "config.yaml"
    old.write_text("spec:\n  mode: adaptive\n  strategies: null\n  bucket_thresholds: [1, 3, 65]\n")
    spec = load_train_config(old, written=True).spec
    assert spec.bucket_thresholds is None and spec.make_tuner().thresholds == [1, 3, 65, 256]
    with pytest.raises(ConfigError, match=r"config.yaml: spec.bucket_thresholds has 3 entries but the default arms "
                                          r"form 4 groups by tokens to verify: give 4, or leave it unset"):
        load_train_config(old)
    own = tmp_path / "own.yaml"
    own.write_text("spec:\n  mode: adaptive\n  strategies: [4_1_5, 2_1_3, 1_1_2]\n  bucket_thresholds: [1, 3, 65]\n")
    assert load_train_config(own, written=True).spec.bucket_thresholds == (1, 3, 65)


def test_a_run_given_relative_paths_resumes_from_any_directory(toy, tmp_path, monkeypatch):
    """config.yaml names the model, data and reward file by absolute path, so `--resume` works
    from another directory; a config.yaml an older tailtamer wrote with the paths as typed
    still resumes from the directory it was started in (same files: no change refused)."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(work)
    relative = [item.split("=", 1)[0] + "=" + os.path.relpath(item.split("=", 1)[1], work)
                if item.startswith(("run.model=", "data.train=", "rl.reward=")) else item for item in toy]
    assert all(not v.startswith("/") for k, v in (i.split("=", 1) for i in relative) if k != "run.out_dir")
    launch(load_train_config(None, relative + ["run.name=rel", "run.steps=1"]), console=quiet)
    run = tmp_path / "runs" / "rel"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["run"]["model"] == toy[0].split("=", 1)[1]
    assert saved["data"]["train"].startswith("/") and saved["rl"]["reward"][0].startswith("/")
    monkeypatch.chdir(elsewhere)
    launch(load_train_config(run / "config.yaml", ["run.steps=2"], written=True), resume=run, console=quiet)
    assert [r["step"] for r in _rows(run)] == [1, 2]
    as_typed = {**saved, "run": {**saved["run"], "model": relative[0].split("=", 1)[1], "steps": 2},
                "data": {**saved["data"], "train": relative[1].split("=", 1)[1]}}
    (run / "config.yaml").write_text(yaml.safe_dump(as_typed, sort_keys=False))
    monkeypatch.chdir(work)
    launch(load_train_config(run / "config.yaml", ["run.steps=3"], written=True), resume=run, console=quiet)
    assert [r["step"] for r in _rows(run)] == [1, 2, 3]


def test_fewer_prompts_than_a_step_takes_is_said_and_checked(toy, tmp_path):
    """4 training prompts and rollout.prompts_per_step=5: each step rolls out the 4, which the
    log says; rl.minibatches must divide the 32 samples a step then has, not the 40 configured."""
    lines = []
    _train(toy, "rollout.prompts_per_step=5", "run.steps=1", "run.name=few", log=lines.append)
    assert any(line.endswith("has 4 training prompts, fewer than rollout.prompts_per_step=5: every step rolls out "
                             "all 4") for line in lines), lines
    assert len(_rows(tmp_path / "runs" / "few")[0]["lengths"]) == 32
    with pytest.raises(ConfigError, match=r"rl.minibatches \(5\) must divide a step's 32 samples: .* has 4 training "
                                          r"prompts, fewer than rollout.prompts_per_step=5, times rollout.group_size=8"):
        _train(toy, "rollout.prompts_per_step=5", "rl.minibatches=5", "run.name=uneven")


def test_responses_the_context_will_cut_are_said_at_start_up(toy, tmp_path):
    lines = []
    _train(toy, "run.steps=1", "run.name=short", log=lines.append)
    assert not any("as truncated" in line for line in lines)
    _train(toy, "run.steps=1", "run.name=long", "rollout.max_new_tokens=300", log=lines.append)
    assert any(line.startswith("rollout.max_new_tokens=300, but the model's context is 256 tokens and prompts take "
                               "up to ") and line.endswith("as truncated") for line in lines), lines


def test_a_run_that_fails_before_its_first_step_keeps_the_logs_that_say_why(toy, tmp_path):
    """vLLM's log (named by the error of a vLLM run that failed at start-up) stays with the
    reward functions' output; every other file goes, and the name is free. A new run under the
    name drops the old logs; a user's directory holding a file of such a name is not a run."""
    from tailtamer.rl.run_dir import FAILURE_LOGS, claim_run_dir

    cfg = load_train_config(None, toy + ["run.name=failed"])
    for kept in ([], ["vllm.log"], list(FAILURE_LOGS)):
        _, lock = claim_run_dir(cfg, None)
        run = tmp_path / "runs" / "failed"
        for name in ("config.yaml", *kept):
            (run / name).write_text(f"{name}\n")
        (run / "metrics.jsonl").write_text("")
        (run / "tensorboard").mkdir()
        lock.release(remove_if_unused=True)
        if not kept:
            assert not run.exists()
            continue
        assert sorted(p.name for p in run.iterdir()) == sorted([".lock", *kept])
        assert all((run / name).read_text() == f"{name}\n" for name in kept)
    _train(toy, "run.steps=1", "run.name=failed")
    assert len(_rows(run)) == 1 and not (run / "vllm.log").exists()
    mine = tmp_path / "runs" / "mine"
    mine.mkdir()
    (mine / "vllm.log").write_text("mine\n")
    with pytest.raises(ConfigError, match="runs/mine is a directory of other files, not a run"):
        _train(toy, "run.steps=1", "run.name=mine")
    assert (mine / "vllm.log").read_text() == "mine\n"
