"""What the command line says about its own usage: unknown arguments named with the command
they were given to, `--version`, where `--resume` was pointed into a run, and the files
`train` reads named by their fields."""

import pytest

from tailtamer import __version__
from tailtamer.cli import main


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as stop:  # argparse's own exit
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv,prog", [
    (["bench", "decode", "--bogus", "x"], "tailtamer bench"),
    (["drafter", "train", "--model", "m", "--data", "d", "--out", "o", "--bogus"], "tailtamer drafter train"),
    (["train", "--seed", "3"], "tailtamer train"),
    (["--bogus", "task", "--out", "t.jsonl"], "tailtamer"),
    (["--bogus"], "tailtamer"),  # it said a command was missing
    (["--version", "--bogus"], "tailtamer"),  # it printed the version
    (["--bogus1", "train", "--bogus2"], "tailtamer"),
    (["drafter", "train", "--model", "m", "--data", "d", "--out", "o", "drafter"], "tailtamer drafter train"),
])
def test_an_unknown_argument_is_named_with_its_command(capsys, argv, prog):
    """argparse reports an unknown argument from the top-level parser: `bench decode --bogus`
    sent the user to `tailtamer --help`, which lists no bench flags."""
    err = _usage_error(capsys, argv)
    assert err.startswith(f"error: {prog}: unrecognized arguments: ") and f"(see {prog} --help)" in err, err


@pytest.mark.parametrize("value", ["-5", "x", str(2 ** 63), "1_000", " 5", "\u0663"])
def test_a_bad_seed_says_what_is_accepted(capsys, value):
    err = _usage_error(capsys, ["task", "--out", "t.jsonl", "--seed", value])
    assert f"argument --seed: '{value}': give an integer from 0 to 2**63-1" in err, err


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"tailtamer {__version__}\n"


@pytest.mark.parametrize("inside,pick", [("checkpoints/step-000004", True), ("checkpoints", False),
                                         ("metrics.jsonl", False)])
def test_resume_pointed_into_a_run_names_the_run(tmp_path, capsys, monkeypatch, inside, pick):
    """`--resume` given a checkpoint said 'not a run directory' without naming the run, nor how
    an older checkpoint is resumed from."""
    run = tmp_path / "runs" / "r"
    (run / "checkpoints" / "step-000004").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {}\n")
    (run / "metrics.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", f"runs/r/{inside}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --resume runs/r/{inside}: inside the run directory runs/r, ") and \
        "give --resume runs/r" in err and len(err.splitlines()) == 1, err
    assert ("to resume from step-000004, write its name into runs/r/checkpoints/latest" in err) == pick, err


@pytest.mark.parametrize("given", ["runs/r", "runs/r/vllm.log"])
def test_resume_of_a_run_that_failed_before_its_first_step_says_there_is_nothing_to_resume(
        tmp_path, capsys, monkeypatch, given):
    """Such a run keeps its logs beside its .lock; --resume of its log sent users to --resume of
    the run, which was then 'not a run directory'."""
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / ".lock").write_text("")
    (run / "vllm.log").write_text("vLLM said why\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", given]) == 2
    assert capsys.readouterr().err == (f"error: --resume {given}: the run runs/r ended before its first step and keeps "
                                       "only vllm.log: nothing to resume; run it again without --resume\n")
    assert (run / "vllm.log").read_text() == "vLLM said why\n"


def test_resume_of_a_directory_beside_a_config_file_is_not_a_run(tmp_path, capsys, monkeypatch):
    """A user's own config.yaml in the working directory made any --resume inside it 'inside
    the run directory .'."""
    (tmp_path / "config.yaml").write_text("run: {}\n")
    (tmp_path / "runs" / "broken").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", "runs/broken"]) == 2
    assert capsys.readouterr().err == ("error: --resume runs/broken: not a run directory (it has no config.yaml); "
                                       "give a run's directory, e.g. runs/default\n")


@pytest.mark.parametrize("override,message", [
    ("spec.drafter={tmp}/nope", "spec.drafter {tmp}/nope: drafter directory not found"),
    ("spec.drafter={tmp}/model", "spec.drafter {tmp}/model: config.json: architecture 'Qwen2ForCausalLM' is not an "
                                 "EAGLE drafter; expected one of"),
    ("spec.drafter={tmp}/wide", "spec.drafter {tmp}/wide does not fit the target model: hidden_size: drafter 128 vs "
                                "target 64"),
    ("run.model={tmp}/nope", "run.model {tmp}/nope: model directory not found"),
    ("data.train={tmp}/nope.jsonl", "data.train {tmp}/nope.jsonl: file not found"),
    ("data.eval={tmp}", "data.eval {tmp}: is a directory"),
    ("rl.reward=[math,{tmp}/nope.py:f]", "rl.reward: {tmp}/nope.py not found"),
])
def test_a_missing_input_of_train_is_named_by_its_field_before_any_worker_starts(model_dir, tmp_path, capsys,
                                                                                 override, message):
    """Found by a worker, these were 'worker 0: /path: ...' (the field unnamed), after the
    launcher's set-up; the data files named only the file."""
    from tailtamer.model.drafter import init_drafter, save_drafter
    from conftest import random_model, tiny_config

    save_drafter(init_drafter(random_model(tiny_config(hidden_size=128))), tmp_path / "wide")  # another target's
    model = [] if override.startswith("run.model") else [f"run.model={model_dir}"]
    drafter = [] if override.startswith("spec.drafter") else ["spec.drafter=suffix"]
    code = main(["train", f"run.out_dir={tmp_path / 'runs'}", *model, *drafter, override.format(tmp=tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert message.format(tmp=tmp_path) in err, err
    assert not (tmp_path / "runs").exists()
