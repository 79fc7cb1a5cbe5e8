"""Resuming a run: what it changes is recorded, what it cannot read is named in one line before
anything is written (torn metrics, corrupt checkpoints and draft histories, run files that are
not files), and a failed resume keeps the run as it was."""

import json
import shutil

import pytest
import yaml

from tailtamer.config import load_train_config
from tailtamer.errors import CheckpointError, ConfigError, DataError
from tailtamer.rl.trainer import TrainingError
from test_run_safety import _train
from test_trainer import _comparable, _rows


def test_resume_records_changed_settings_and_refuses_fixed_ones(toy, tmp_path, model_dir, monkeypatch):
    _train(toy, "run.steps=2", "run.name=r", "run.save_every=2")
    run = tmp_path / "runs" / "r"
    lines = []
    _train(toy, "run.steps=3", "rl.lr=5e-4", resume=run, log=lines.append)
    assert any("rl.lr 0.0001 -> 0.0005" in line and "run.steps 2 -> 3" in line for line in lines)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["rl"]["lr"] == 5e-4 and saved["run"]["steps"] == 3  # what the run went on with
    record = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert record == [{"step": 2, "changes": {"rl.lr": [1e-4, 5e-4], "run.steps": [2, 3]}}]
    with pytest.raises(ConfigError, match="run.model cannot change when a run is resumed"):
        _train(toy, "run.steps=4", f"run.model={tmp_path}", resume=run)
    files = {p: p.read_bytes() for p in run.iterdir() if p.is_file()}
    for steps in (3, 2):  # a resume with no step to take changes nothing
        with pytest.raises(ConfigError, match=rf"the run is at step 3 and run.steps is {steps}, so there is nothing "
                                              r"to train; give run.steps=4 or more"):
            _train(toy, f"run.steps={steps}", resume=run)
    # with several workers, the launcher says so before it spawns any (a worker's refusal came
    # with the other workers' connection errors)
    from tailtamer.rl import trainer

    monkeypatch.setattr(trainer, "spawn", lambda *args: pytest.fail("workers spawned"))
    with pytest.raises(ConfigError, match=r"the run is at step 3 and run.steps is 3, so there is nothing to train"):
        trainer.launch(load_train_config(run / "config.yaml", ["run.workers=2"]), resume=run)
    assert {p: p.read_bytes() for p in run.iterdir() if p.is_file()} == files


def test_resume_after_a_torn_metrics_line(toy, tmp_path):
    _train(toy, "run.steps=4", "run.name=whole", "run.save_every=2", "rl.lr=1e-3")
    _train(toy, "run.steps=2", "run.name=torn", "run.save_every=2", "rl.lr=1e-3")
    run = tmp_path / "runs" / "torn"
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward_me')  # a kill in the middle of a write
    lines = []
    _train(toy, "run.steps=4", resume=run, log=lines.append)
    assert any("dropped its last line, unreadable (a run killed while writing" in line for line in lines)
    assert _comparable(_rows(run)) == _comparable(_rows(tmp_path / "runs" / "whole"))


@pytest.mark.parametrize("part", ["model.safetensors", "optimizer.pt", "state.json", "config.json"])
def test_a_corrupt_checkpoint_file_is_named_on_resume(toy, tmp_path, part):
    _train(toy, "run.steps=2", "run.name=c", "run.save_every=1")
    run = tmp_path / "runs" / "c"
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    (latest / part).write_bytes(b"\x00garbage{")
    with pytest.raises(CheckpointError, match=f"{latest.name}.*(cannot|malformed|{part}).*; step-000001, the "
                                              f"checkpoint before it, can be resumed from: write its name into "
                                              f"{run / 'checkpoints' / 'latest'}$"):
        _train(toy, "run.steps=3", resume=run)
    if part == "model.safetensors":  # the advice works
        (run / "checkpoints" / "latest").write_text("step-000001\n")
        _train(toy, "run.steps=3", resume=run)
        assert [r["step"] for r in _rows(run)] == [1, 2, 3]


def test_the_draft_history_is_saved_with_the_checkpoint_and_a_bad_one_is_named(toy, tmp_path):
    """The suffix drafter's history goes into every checkpoint; a resume reads it back (or, told
    so, starts without it); a corrupt one is one line naming the file, and nothing is lost."""
    suffix = ["spec.mode=on", "spec.drafter=suffix", "rollout.max_new_tokens=8", "run.save_every=1"]
    _train(toy, *suffix, "run.steps=2", "run.name=h")
    run = tmp_path / "runs" / "h"
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    blob = json.loads((latest / "draft_history.json").read_text())
    assert blob["vocab_size"] > 0 and len(blob["workers"]) == 1
    # 4 prompts x 8 samples a step, 8 kept per prompt: the last step's responses
    assert len(blob["workers"][0]) == 4 and all(len(responses) == 8 for _, responses in blob["workers"][0])
    (latest / "draft_history.json").write_text('{"format": "tailtamer draft history", "workers": [[["x", [[1]]]]]}')
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match=f"{latest / 'draft_history.json'}: cannot read the draft history .*"
                                              f"spec.history_on_resume=fresh"):
        _train(toy, "run.steps=3", resume=run)
    assert (run / "metrics.jsonl").read_text() == before and latest.is_dir()
    saved = (latest / "draft_history.json").read_text()
    (latest / "draft_history.json").unlink()
    (latest / "draft_history.json").mkdir()  # not a file either: named as well, not taken for no history
    with pytest.raises(CheckpointError, match=f"{latest / 'draft_history.json'}: cannot read the draft history"):
        _train(toy, "run.steps=3", resume=run)
    (latest / "draft_history.json").rmdir()
    (latest / "draft_history.json").symlink_to(tmp_path / "gone")  # a broken link: named, not taken for none
    with pytest.raises(CheckpointError, match=f"{latest / 'draft_history.json'}: cannot read the draft history"):
        _train(toy, "run.steps=3", resume=run)
    (latest / "draft_history.json").unlink()
    (latest / "draft_history.json").write_text(saved)
    lines = []
    _train(toy, "run.steps=3", "spec.history_on_resume=fresh", resume=run, log=lines.append)
    assert "spec.history_on_resume=fresh: the suffix drafts start without the checkpoint's history" in lines
    assert [r["step"] for r in _rows(run)] == [1, 2, 3]
    # for that resume only: the next one loads the history step 3 saved (it stands in resumes.jsonl)
    assert yaml.safe_load((run / "config.yaml").read_text())["spec"]["history_on_resume"] == "load"
    assert json.loads((run / "resumes.jsonl").read_text().splitlines()[-1])["changes"] == {
        "run.steps": [2, 3], "spec.history_on_resume": ["load", "fresh"]}
    lines = []
    _train(toy, "run.steps=4", resume=run, log=lines.append)
    assert not any("history_on_resume" in line or "holds no draft history" in line for line in lines), lines


def test_lines_torn_mid_file_are_named_not_blamed_on_a_kill(tmp_path):
    from tailtamer.rl.run_dir import keep_metrics_through

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\ngarbage\n{"step": 2}\n{"step": 3, "x\n')
    lines = []
    assert [r["step"] for r in keep_metrics_through(path, 2, lines.append)] == [1, 2]
    assert lines == [f"{path}: dropped unreadable lines 2, 4 (edited by hand?)"]


@pytest.mark.parametrize("name,make", [("samples.jsonl", "dir"), ("metrics.jsonl", "dir"), ("resumes.jsonl", "dir"),
                                       ("drafter", "file"), ("summary.json", "dangling")])
def test_a_resume_refuses_a_run_file_that_is_not_one_before_writing(toy, tmp_path, name, make):
    """A directory where the run keeps a file (or the reverse) stopped a resume only after it had
    rewritten config.yaml, recorded the resume and replaced a finished run's summary.json."""
    _train(toy, "run.steps=2", "run.name=r")
    run = tmp_path / "runs" / "r"
    target = run / name
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)
    {"dir": target.mkdir, "file": lambda: target.write_text("x"),
     "dangling": lambda: target.symlink_to(tmp_path / "gone")}[make]()
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=rf"--resume .*runs/r: {name} is .*, where the run keeps .*; move it away"):
        _train(toy, "run.steps=4", resume=run)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files


def test_a_resume_that_fails_before_its_first_step_keeps_the_summary(toy, tmp_path, monkeypatch):
    from tailtamer.rl import trainer

    _train(toy, "run.steps=2", "run.name=s")
    run = tmp_path / "runs" / "s"
    summary = (run / "summary.json").read_text()
    assert json.loads(summary)["finished"]

    def broken(s):
        raise TrainingError("the step failed")
    monkeypatch.setattr(trainer, "rl_step", broken)
    with pytest.raises(TrainingError, match="the step failed"):
        _train(toy, "run.steps=4", resume=run)
    assert (run / "summary.json").read_text() == summary


def test_a_resume_cannot_swap_the_drafter_its_checkpoints_keep(tmp_path):
    """A resume with another spec.drafter went on with the checkpoint's drafter, yet recorded the
    new one as applied (and config.yaml named it, failing later runs of that config)."""
    from tailtamer.config import to_dict
    from tailtamer.rl.run_dir import resume_changes

    run = tmp_path / "r"
    (run / "checkpoints" / "step-000002" / "drafter").mkdir(parents=True)
    cfg = load_train_config(None, [f"run.out_dir={tmp_path}", "run.name=r"])
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    other = load_train_config(None, [f"run.out_dir={tmp_path}", "run.name=r", f"spec.drafter={tmp_path / 'other'}"])
    with pytest.raises(ConfigError, match=r"spec.drafter cannot change: the run's drafter is trained on and kept in its "
                                          r"checkpoints"):
        resume_changes(run, to_dict(other))
    assert resume_changes(run, to_dict(cfg)) == {}


def test_a_resumed_run_needs_spec_drafter_only_where_it_still_reads_it(tmp_path, model_dir):
    """A resume goes on with the drafter its checkpoint keeps: the start-up check of
    spec.drafter refused a run whose original drafter directory was gone, and spec.drafter
    cannot change on resume, so the run could not go on at all."""
    from tailtamer.rl.run_state import check_inputs

    checkpoint = tmp_path / "r" / "checkpoints" / "step-000002"
    (checkpoint / "drafter").mkdir(parents=True)
    gone = tmp_path / "gone"
    cfg = load_train_config(None, [f"run.out_dir={tmp_path}", f"run.model={model_dir}", f"spec.drafter={gone}",
                                   "spot.compare_frozen=false"])
    check_inputs(cfg, checkpoint, world=2)
    with pytest.raises(CheckpointError, match=f"spec.drafter {gone}: drafter directory not found"):
        check_inputs(cfg, None, world=2)  # a first run reads it
    frozen = load_train_config(None, [f"run.out_dir={tmp_path}", f"run.model={model_dir}", f"spec.drafter={gone}",
                                      "spot.compare_frozen=true"])
    with pytest.raises(CheckpointError, match="drafter directory not found"):  # the frozen copy compared with
        check_inputs(frozen, checkpoint, world=2)
    check_inputs(frozen, checkpoint, world=1)  # one worker trains no drafter (spot.single_worker=never)


def test_a_data_file_the_run_does_not_read_is_not_required(tmp_path, model_dir):
    from tailtamer.rl.run_state import check_inputs

    missing = tmp_path / "eval.jsonl"
    check_inputs(load_train_config(None, [f"run.model={model_dir}", "spec.drafter=suffix", f"data.eval={missing}",
                                          "run.eval_every=0"]))
    with pytest.raises(DataError, match=f"data.eval {missing}: file not found"):
        check_inputs(load_train_config(None, [f"run.model={model_dir}", "spec.drafter=suffix", f"data.eval={missing}",
                                              "run.eval_every=5"]))
