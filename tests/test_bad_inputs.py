"""Bad input found by probing the CLI as a user would: each case ends in one clear line (exit 2)
or is handled, never a traceback, a silently wrong result or an overwritten file."""

import json
import os
import shutil
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from tailtamer.cli import main
from tailtamer.config import load_train_config
from tailtamer.errors import CheckpointError, ConfigError, DataError, TailtamerError
from tailtamer.rl.trainer import train
from conftest import write_jsonl


def _one_line_error(capsys, message: str, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert message in err, err
    return err


def _prompts(tmp_path, rows=({"prompt": "ab", "answer": "1"},)):
    return write_jsonl(tmp_path / "p.jsonl", list(rows))


# --- outputs never overwrite inputs ---------------------------------------------------------

@pytest.mark.parametrize("case", ["out-is-prompts", "out-in-model", "stats-is-out", "stats-unwritable"])
def test_generate_never_writes_over_its_inputs(model_dir, tmp_path, capsys, case):
    prompts = _prompts(tmp_path)
    before = prompts.read_text(), (model_dir / "config.json").read_text()
    out = {"out-is-prompts": prompts, "out-in-model": model_dir / "config.json"}.get(case, tmp_path / "o.jsonl")
    extra = {"stats-is-out": ["--stats", str(out)], "stats-unwritable": ["--stats", "/proc/nope/s.json"]}.get(case, [])
    code = main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out), *extra])
    message = {"out-is-prompts": "would overwrite --prompts", "out-in-model": "would overwrite --model",
               "stats-is-out": "would overwrite --out", "stats-unwritable": "cannot create a directory in /proc ("}[case]
    _one_line_error(capsys, message, code)
    assert (prompts.read_text(), (model_dir / "config.json").read_text()) == before
    assert not (tmp_path / "o.jsonl").exists()


def test_bench_never_writes_over_its_model(model_dir, tmp_path, capsys):
    before = (model_dir / "config.json").read_text()
    code = main(["bench", "decode", "--model", str(model_dir), "--out", str(model_dir / "config.json"), "--repeats", "1"])
    _one_line_error(capsys, "would overwrite --model", code)
    assert (model_dir / "config.json").read_text() == before
    with pytest.raises(SystemExit) as stop:  # argparse's own exit
        main(["bench", "decode", "--out", "", "--repeats", "1"])
    _one_line_error(capsys, "argument --out: empty; give a value", stop.value.code)


def test_an_output_never_replaces_a_file_of_another_model_or_run(model_dir, tmp_path, capsys):
    """`task --out` or `generate --out` naming a file of a model other than the inputs (or of a
    training run) replaced it: the model no longer loaded. A file the run has yet to write is its
    too. An output ending in '/' wrote a file."""
    other, run = tmp_path / "other-model", tmp_path / "runs" / "r"
    shutil.copytree(model_dir, other)
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("run: {}\n")
    (run / "metrics.jsonl").write_text("{}\n")
    (run / ".lock").write_text("123\n")
    before = {p: p.read_bytes() for p in [*other.iterdir(), *run.iterdir()]}
    for out, owner in ((other / "model.safetensors", f"the model or drafter {other}"),
                       (other / "config.json", f"the model or drafter {other}"),
                       (run / "metrics.jsonl", f"the training run {run}"),
                       (run / "summary.json", f"the training run {run}"),  # not written yet: the run's to write
                       (run / "checkpoints" / "step-9" / "x.json", f"the training run {run}")):
        _one_line_error(capsys, f"would replace a file of {owner}", main(["task", "--out", str(out), "--n", "2"]))
        code = main(["generate", "--model", str(model_dir), "--prompts", str(_prompts(tmp_path)), "--out", str(out)])
        _one_line_error(capsys, f"would replace a file of {owner}", code)
    assert {p: p.read_bytes() for p in before} == before
    failed = tmp_path / "runs" / "failed"  # what a run that failed before its first step keeps
    failed.mkdir()
    for name in (".lock", "vllm.log", "reward.log"):
        (failed / name).write_text(f"{name}\n")
    for log in ("vllm.log", "reward.log"):
        _one_line_error(capsys, f"would replace a file of the training run {failed}",
                        main(["task", "--out", str(failed / log), "--n", "2"]))
        assert (failed / log).read_text() == f"{log}\n"
    for own in (other / "new.jsonl", run / "gen.jsonl"):  # the user's own files beside them, written again
        for _ in range(2):
            assert main(["task", "--out", str(own), "--n", "2"]) == 0
    _one_line_error(capsys, "ends with a '/'", main(["task", "--out", str(tmp_path / "dir") + "/", "--n", "2"]))
    assert not (tmp_path / "dir").exists()


def test_files_and_devices_where_directories_belong_are_named(model_dir, tmp_path, capsys):
    prompts = _prompts(tmp_path)
    code = main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
                 "--spec", "on", "--drafter", str(prompts)])
    _one_line_error(capsys, f"--drafter {prompts}: a file; a drafter is a directory", code)
    code = main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
                 "--spec", "on", "--drafter", str(tmp_path / "nope")])
    _one_line_error(capsys, f"--drafter {tmp_path / 'nope'}: drafter directory not found", code)
    _one_line_error(capsys, "--out /dev/null is not a directory; give a directory to create",
                    main(["init-model", "--preset", "tiny", "--out", "/dev/null"]))
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "tokenizer.json").mkdir()
    code = main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")])
    _one_line_error(capsys, "tokenizer.json: not a file", code)


def test_an_output_is_never_written_over_a_pipe_and_follows_a_link(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _one_line_error(capsys, "is not a regular file", main(["task", "--out", str(fifo), "--n", "2"]))
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    target, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    target.write_text("old\n")
    link.symlink_to(target)
    assert main(["task", "--out", str(link), "--n", "2"]) == 0
    assert link.is_symlink() and len(target.read_text().splitlines()) == 2


def test_a_batch_size_of_zero_names_the_flag(model_dir, tmp_path, capsys):
    code = main(["generate", "--model", str(model_dir), "--prompts", str(_prompts(tmp_path)), "--out",
                 str(tmp_path / "o.jsonl"), "--max-batch-size", "0"])
    _one_line_error(capsys, "--max-batch-size must be >= 1", code)


def test_more_responses_than_memory_holds_are_refused_before_generating(model_dir, tmp_path, capsys):
    from tailtamer.arguments import check_responses_fit
    from tailtamer.memory import responses_bytes

    check_responses_fit(2, 8, 256, "advice", available=responses_bytes(16, 256))  # exactly fits
    with pytest.raises(TailtamerError, match="2 prompts x 9 samples of up to 256 tokens may need .*; advice"):
        check_responses_fit(2, 9, 256, "advice", available=responses_bytes(16, 256))
    code = main(["generate", "--model", str(model_dir), "--prompts", str(_prompts(tmp_path)), "--out",
                 str(tmp_path / "o.jsonl"), "--n", str(10 ** 12)])
    _one_line_error(capsys, f"1 prompt x {10 ** 12} samples of up to 256 tokens", code)
    assert not (tmp_path / "o.jsonl").exists()
    _one_line_error(capsys, "; lower --prompts or --n", main(["demo", "--prompts", str(10 ** 12), "--out",
                                                               str(tmp_path / "demo")]))
    assert not (tmp_path / "demo").exists()


def test_demo_never_writes_into_its_model(model_dir, capsys):
    code = main(["demo", "--model", str(model_dir), "--out", str(model_dir / "demo")])
    _one_line_error(capsys, "would write into --model", code)
    assert not (model_dir / "demo").exists()


def test_drafter_texts_too_short_to_train_on_name_the_file(model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "short.jsonl", [{"text": ""}, {"text": "a"}])
    code = main(["drafter", "train", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "d")])
    _one_line_error(capsys, f"--data {data}: drafter training needs sequences of at least 3 tokens", code)
    assert not (tmp_path / "d").exists()


def test_demo_never_writes_into_another_directory(tmp_path, capsys):
    other = tmp_path / "run"
    other.mkdir()
    (other / "metrics.jsonl").write_text("{}\n")
    _one_line_error(capsys, "already exists and holds metrics.jsonl;", main(["demo", "--out", str(other)]))
    (tmp_path / "f").write_text("x")
    _one_line_error(capsys, "is a file", main(["demo", "--out", str(tmp_path / "f")]))


def test_outputs_are_readable_by_others(model_dir, tmp_path):
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--model", str(model_dir), "--prompts", str(_prompts(tmp_path)), "--out", str(out),
                 "--max-new-tokens", "2"]) == 0
    assert stat.S_IMODE(out.stat().st_mode) & 0o044 == 0o044 & ~_umask()


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- configs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (["rl.overlong=penalty", "rollout.max_new_tokens=8"], "rl.overlong_buffer (64) must be below rollout.max_new_tokens"),
    (["rl.reward_timeout_s=1e7"], "rl.reward_timeout_s must be <= 86400"),
    (["run.dist_timeout_s=1e300"], "run.dist_timeout_s must be <= 604800"),
    (["run.dist_timeout_s=1e-9"], "run.dist_timeout_s must be >= 1"),
    (["data.prompt_key=question"], "data.prompt_key names a column of a prompts file; data.train=builtin reads none"),
    (["run.name=../escape"], "run.name must be a plain directory name"),
    (["run.name=a/b"], "run.name must be a plain directory name"),
    (["run.name=."], "run.name must be a plain directory name"),
    (["spec.strategy=²_1_2"], "spec.strategy"),
    (["run.seed=-5"], "run.seed must be >= 0"),
    (["run.seed=99999999999999999999999"], "run.seed must be <= 4294967295"),
    (["run.model=/nonexistent/model"], "run.model /nonexistent/model: model directory not found"),
    (["run.model=/"], "run.model /: no config.json or tokenizer.json, so not a model directory"),  # not the drafter
])
def test_more_bad_configs(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_train_config(None, overrides)


@pytest.mark.parametrize("text", ["rl: {lr: 1e-5}\nrl: {clip_low: 0.1}\n", "rl:\n  lr: 1e-5\n  lr: 2e-5\n"])
def test_a_key_given_twice_is_an_error_not_a_silent_drop(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="duplicate key"):
        load_train_config(path)


def test_yaml_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_train_config(None, ["rl.lr=["])
    assert len(str(e.value).splitlines()) == 1
    path = tmp_path / "c.yaml"
    path.write_bytes(b"rl:\n  lr: \xff\n")
    with pytest.raises(ConfigError, match="not valid UTF-8"):
        load_train_config(path)


def test_usage_errors_are_one_line(capsys):
    code = None
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "m", "--prompts", "p", "--out", "o", "--n", "abc"])
    code = e.value.code
    _one_line_error(capsys, "--n: invalid int value", code)
    with pytest.raises(SystemExit) as e:
        main(["init-model", "--preset", "tiny", "--out", "x", "--seed", "9" * 20])
    _one_line_error(capsys, f"--seed: '{'9' * 20}': give an integer from 0 to 2**63-1", e.value.code)


@pytest.mark.parametrize("argv,message", [
    (["sft", "--steps", "0", "--out", "x"], "--steps must be >= 1, got 0"),
    (["drafter", "train", "--model", "m", "--data", "builtin", "--out", "d", "--steps", "0"], "--steps must be >= 1"),
    (["drafter", "train", "--model", "m", "--data", "builtin", "--out", "d", "--unroll", "0"], "--unroll must be >= 1"),
    (["drafter", "train", "--model", "m", "--data", "builtin", "--out", "d", "--unroll", "100000"],
     "--unroll must be at most 64, the deepest draft, got 100000"),  # it ran for minutes a step
])
def test_counts_below_one_name_the_flag(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    _one_line_error(capsys, message, main(argv))
    assert not any(tmp_path.iterdir())


# --- data ---------------------------------------------------------------------------------------

def test_whole_float_answers_are_integers_and_missing_ones_are_errors(tmp_path):
    pd = pytest.importorskip("pandas")
    from tailtamer.model.tokenizer import char_tokenizer
    from tailtamer.rl.data import load_task_rows

    path = tmp_path / "d.parquet"
    pd.DataFrame({"prompt": ["a", "b", "c"], "answer": [57, 14, 3]}).astype({"answer": float}).to_parquet(path)
    rows, _ = load_task_rows(path, char_tokenizer(), 64)
    assert [r["answer"] for r in rows] == ["57", "14", "3"]  # not '57.0', which no reward would match
    frame = pd.DataFrame({"prompt": ["a", "b"], "answer": [57, None]})
    frame.to_parquet(path)
    with pytest.raises(DataError, match=r"d\.parquet:2: field 'answer' is nan"):
        load_task_rows(path, char_tokenizer(), 64)


@pytest.mark.parametrize("answer,message", [([1, 2], "must be a string or a number, got list"),
                                            (True, "must be a string or a number, got bool"), ("  ", "is empty"),
                                            ({"a": 1}, "must be a string or a number, got dict")])
def test_bad_answers_name_file_and_row(tmp_path, answer, message):
    from tailtamer.model.tokenizer import char_tokenizer
    from tailtamer.rl.data import load_task_rows

    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": answer}])
    with pytest.raises(DataError, match=f"d.jsonl:2: field 'answer' {message}"):
        load_task_rows(path, char_tokenizer(), 64)


@pytest.mark.parametrize("line,message", [('{"prompt": "\\ud800"}', "the prompt is not valid Unicode"),
                                          ('{"prompt": "b", "messages": [{"role": "user", "content": "c"}]}',
                                           "row has both 'prompt' and 'messages'; keep one"),
                                          ("[" * 100_000, "JSON nested too deeply"),
                                          ('{"prompt": "b", "answer": ' + "9" * 5000 + "}",
                                           "a number Python will not read (Exceeds the limit")])
def test_unusable_prompt_rows(model_dir, tmp_path, capsys, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n' + line + "\n")
    code = main(["generate", "--model", str(model_dir), "--prompts", str(path), "--out", str(tmp_path / "o.jsonl")])
    _one_line_error(capsys, f"p.jsonl:2: {message}", code)


def test_a_broken_chat_template_names_the_row_and_its_file(model_dir, tmp_path, capsys):
    """A template that fails on a row names both; one that does not parse (whatever the row) was
    blamed on the prompts file's first row: it names the model's file alone."""
    config_path, jinja = model_dir / "tokenizer_config.json", model_dir / "chat_template.jinja"
    config = json.loads(config_path.read_text())
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    for template, message in (("{{ messages[0].content / 0 }}", f"p.jsonl:1: chat template error ({config_path}): "),
                              ("{% for m in messages %}{{ m.content }", f"error: {config_path}: its chat template "
                                                                        f"does not parse (TemplateSyntaxError")):
        config_path.write_text(json.dumps({**config, "chat_template": template}))
        code = main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")])
        _one_line_error(capsys, message, code)
    jinja.write_text("{{ messages[0].content }")  # transformers' own file wins over the config's
    code = main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")])
    _one_line_error(capsys, f"error: {jinja}: its chat template does not parse", code)


def test_named_chat_templates_and_checked_tokenizer_config(model_dir):
    from tailtamer.model.tokenizer import load_tokenizer

    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {**config, "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_tokenizer(model_dir).chat_template == "D"
    for bad in ([1, 2], {**config, "eos_token": 5}):
        (model_dir / "tokenizer_config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match="tokenizer_config.json"):
            load_tokenizer(model_dir)


def test_a_prompt_longer_than_the_context_is_skipped_at_start_up(toy, tmp_path):
    data = write_jsonl(tmp_path / "long.jsonl", [{"prompt": p, "answer": "0"} for p in ["ab", "cd", "ef", "gh"]]
                       + [{"prompt": "1" * 300, "answer": "1"}])  # the test model's context is 256
    lines = []
    summary = train(load_train_config(None, toy + [f"data.train={data}", "data.max_prompt_tokens=2000",
                                                   "run.steps=2", "run.name=long"]), log=lines.append)
    assert summary["skipped_prompts"] == 1 and any("longer than 255 tokens" in line for line in lines)


# --- model and drafter directories ----------------------------------------------------------------

def _edit_config(model_dir, **changes):
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("changes,message", [
    ({"eos_token_id": 100000}, "must be token ids"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a finite number > 0"),
    ({"max_position_embeddings": 2 ** 31 - 1}, "config.json: max_position_embeddings must be at most 16,777,216"),
    ({"rope_theta": 0, "rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_theta must be a finite"),
    ({"architectures": [["Qwen2ForCausalLM"]]}, "architectures must be a list of names"),
    ({"vocab_size": 10 ** 30}, "vocab_size must be a positive integer below 2**31"),
    ({"num_hidden_layers": 10 ** 7}, "num_hidden_layers is 10000000 but model.safetensors holds 2 layer(s)"),
    ({"num_hidden_layers": 1}, "num_hidden_layers is 1 but model.safetensors holds 2 layer(s)"),
])
def test_config_json_values_that_would_run_wrong_or_hang(model_dir, changes, message):
    from tailtamer.model.io import load_model

    _edit_config(model_dir, **changes)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        load_model(model_dir)


def test_tensors_the_config_does_not_describe_are_refused(model_dir):
    from tailtamer.model.io import load_model

    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="1 tensor\\(s\\) the config does not describe: extra.weight"):
        load_model(model_dir)


@pytest.mark.parametrize("index", [[], {"weight_map": []}, {"weight_map": {"a": ["x"]}}, {"weight_map": {"a": "../x"}}])
def test_bad_sharded_indexes(model_dir, index):
    from tailtamer.model.io import load_model

    (model_dir / "model.safetensors").unlink()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="index.json"):
        load_model(model_dir)


def _shard(model_dir):
    """The model's weights in two shards and an index; returns (tensors, weight_map)."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {k: "model-0000{}-of-00002.safetensors".format(1 + (i >= len(names) // 2)) for i, k in enumerate(names)}
    for shard in set(weight_map.values()):
        save_file({k: v for k, v in tensors.items() if weight_map[k] == shard}, str(model_dir / shard))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors, weight_map


def test_sharded_weights_load_from_the_shard_the_index_names(model_dir):
    """A tensor also in another shard was taken from whichever shard came last (a different
    model, silently); a shard the index leaves out was blamed on config.json's layer count."""
    from tailtamer.model.io import load_model

    reference = load_model(model_dir).state_dict()
    tensors, weight_map = _shard(model_dir)
    assert all(torch.equal(v, reference[k]) for k, v in load_model(model_dir).state_dict().items())
    first = next(k for k, v in weight_map.items() if v.startswith("model-00001"))
    second = "model-00002-of-00002.safetensors"
    stray = {**load_file(str(model_dir / second)), first: torch.zeros_like(tensors[first])}
    save_file(stray, str(model_dir / second))
    with pytest.raises(CheckpointError, match=f"index.json: its weight_map does not match {second}: {second} holds "
                                              f"{first}, mapped to another shard"):
        load_model(model_dir)
    save_file({k: v for k, v in stray.items() if k != first}, str(model_dir / second))
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in weight_map.items() if v != second}  # one shard left out
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"but model.safetensors.index.json holds \d+ layer"):
        load_model(model_dir)


@pytest.mark.parametrize("changes,message", [({"num_hidden_layers": 3}, "num_hidden_layers 1"),
                                             ({"rope_theta": 5.0}, "rope_theta"),
                                             ({"architectures": ["LlamaForCausalLMEagle"]}, "architecture")])
def test_drafters_made_for_something_else_are_refused(model_dir, tmp_path, changes, message):
    from tailtamer.model.drafter import init_drafter, load_drafter, save_drafter
    from tailtamer.model.io import load_model

    target = load_model(model_dir)
    save_drafter(init_drafter(target), tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config.update(changes)
    if "rope_theta" in changes:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": changes["rope_theta"]}
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_drafter(tmp_path / "d", target)


def test_non_finite_drafters_are_neither_written_nor_loaded(model_dir, tmp_path, capsys):
    from tailtamer.model.drafter import init_drafter, load_drafter, save_drafter
    from tailtamer.model.io import load_model

    texts = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world 1+2=3"}])
    for lr, message in (("inf", "lr must be a finite number > 0"), ("0", "lr must be a finite number > 0"),
                        ("-1", "lr must be a finite number > 0")):
        code = main(["drafter", "train", "--model", str(model_dir), "--data", str(texts), "--out", str(tmp_path / "o"),
                     "--steps", "3", "--lr", lr])
        _one_line_error(capsys, message, code)
        assert not (tmp_path / "o" / "model.safetensors").exists()
    target = load_model(model_dir)
    drafter = init_drafter(target)
    with torch.no_grad():
        drafter.fc.weight[0, 0] = float("nan")
    save_drafter(drafter, tmp_path / "nan")
    with pytest.raises(CheckpointError, match="non-finite values"):
        load_drafter(tmp_path / "nan", target)


def test_non_finite_logits_stop_generation_with_a_clear_error(model_dir, tmp_path, capsys):
    """Weights that are finite but overflow (a huge norm scale) give NaN logits: an error, not
    a token sampled from garbage."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], 3e38)
    save_file(tensors, str(model_dir / "model.safetensors"))
    for temperature in ("1", "0"):
        code = main(["generate", "--model", str(model_dir), "--prompts", str(_prompts(tmp_path)),
                     "--out", str(tmp_path / "o.jsonl"), "--temperature", temperature])
        _one_line_error(capsys, "non-finite logits", code)


def test_a_tiny_temperature_samples_the_argmax(model_dir, tmp_path):
    out = tmp_path / "o.jsonl"
    tokens = []
    for temperature in ("1e-300", "0"):
        assert main(["generate", "--model", str(model_dir), "--prompts", str(_prompts(tmp_path)), "--out", str(out),
                     "--max-new-tokens", "6", "--temperature", temperature, "--top-p", "1e-300"]) == 0
        tokens.append(json.loads(out.read_text())["token_ids"])
    assert tokens[0] == tokens[1]


# --- runs -----------------------------------------------------------------------------------------

def test_an_empty_resume_path_is_an_error(capsys):
    _one_line_error(capsys, "--resume: empty path", main(["train", "--resume", ""]))


def test_a_run_that_fails_in_its_first_step_leaves_no_directory(toy, tmp_path):
    reward = tmp_path / "boom.py"
    reward.write_text("def boom(response, answer):\n    raise RuntimeError('no')\n")
    with pytest.raises(Exception, match="every reward of step 1 failed"):
        train(load_train_config(None, toy + [f"rl.reward={reward}:boom", "run.name=dead"]), log=lambda _: None)
    assert not (tmp_path / "runs" / "dead").exists()
    train(load_train_config(None, toy + ["run.name=dead", "run.steps=1"]), log=lambda _: None)  # the name is free


HINT = r"; step-000001, a complete checkpoint, can be resumed from: write its name into .*checkpoints/latest$"


@pytest.mark.parametrize("latest,state,message", [
    (b"\xff\xfe", None, "expected the name of a checkpoint of this run.*" + HINT),
    (b"../../other/checkpoints/step-000002", None, "expected the name of a checkpoint of this run.*" + HINT),
    (b"", None, r"no checkpoint to resume from \(checkpoints/latest is missing\)" + HINT),
    (None, {"step": "2"}, "step must be an integer >= 0"),
    (None, {"step": -3}, "step must be an integer >= 0"),
])
def test_tampered_checkpoints_are_refused_on_resume(toy, tmp_path, latest, state, message):
    train(load_train_config(None, toy + ["run.name=t", "run.steps=1"]), log=lambda _: None)
    run = tmp_path / "runs" / "t"
    if latest == b"":
        (run / "checkpoints" / "latest").unlink()
    elif latest is not None:
        (run / "checkpoints" / "latest").write_bytes(latest)
    if state is not None:
        (run / "checkpoints" / "step-000001" / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=message):
        train(load_train_config(run / "config.yaml", ["run.steps=2"]), resume=run, log=lambda _: None)


def test_a_run_without_held_out_prompts_writes_no_nan(toy, tmp_path):
    summary = train(load_train_config(None, toy + ["run.name=noeval", "run.steps=2", "run.eval_every=1"]),
                    log=lambda _: None)
    text = (tmp_path / "runs" / "noeval" / "metrics.jsonl").read_text() + json.dumps(summary)
    assert "NaN" not in text and summary["eval_accuracy_start"] is None


# --- rewards ------------------------------------------------------------------------------------------

def test_a_reward_module_in_the_working_directory_is_found(tmp_path, monkeypatch):
    from tailtamer.rl.rewards import RewardScorer

    (tmp_path / "myreward.py").write_text("def f(response, answer):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    assert RewardScorer("myreward:f").score("a", "b") == 1.0


@pytest.mark.parametrize("body", ["raise KeyboardInterrupt", "import sys; sys.exit(3)"])
def test_a_reward_module_that_stops_on_import_is_a_startup_error(tmp_path, body):
    from tailtamer.rl.rewards import RewardScorer

    (tmp_path / "bad.py").write_text(body + "\ndef f(r, a):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="cannot (load|import)"):
        RewardScorer(f"{tmp_path / 'bad.py'}:f")
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_task_count_larger_than_the_disk_is_refused_before_writing(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    free = shutil.disk_usage(tmp_path).free
    _one_line_error(capsys, "of prompts, more than the", main(["task", "--n", str(free), "--out", str(out)]))
    assert not out.exists()
    assert main(["task", "--n", "3", "--out", str(out)]) == 0  # written row by row, as `dataset` draws them
    from tailtamer.tasks.arithmetic import ArithmeticTask
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [{"prompt": p["prompt"], "answer": p["answer"]} for p in ArithmeticTask().dataset(3, 0)]


def test_more_built_in_problems_than_memory_holds_are_refused_before_drawing(toy, tmp_path, capsys):
    from tailtamer.memory import BUILTIN_ROW_BYTES
    from tailtamer.rl.data import check_builtin_fits
    from tailtamer.rl.trainer import launch

    builtin = [o for o in toy if not o.startswith("data.train=")]
    cfg = load_train_config(None, builtin + ["data.n_builtin=100", "data.n_eval=20"])
    check_builtin_fits(cfg, 120 * BUILTIN_ROW_BYTES)  # exactly fits: training and held-out problems
    with pytest.raises(ConfigError, match=r"^data.n_builtin=100: .* more than the .* available; lower data.n_builtin$"):
        check_builtin_fits(cfg, 120 * BUILTIN_ROW_BYTES - 1)
    cfg = load_train_config(None, builtin + ["data.n_builtin=100", "data.n_eval=200"])
    with pytest.raises(ConfigError, match="^data.n_eval=200: .*; lower data.n_eval$"):
        check_builtin_fits(cfg, 120 * BUILTIN_ROW_BYTES)
    check_builtin_fits(load_train_config(None, toy + ["data.n_builtin=100"]), 0)  # a file's rows: not drawn
    with pytest.raises(ConfigError, match=f"^data.n_builtin={10 ** 13}: "):  # before hours of drawing problems
        launch(load_train_config(None, builtin + [f"data.n_builtin={10 ** 13}", "run.workers=1"]))
    assert not (tmp_path / "runs").exists()


def test_bench_train_replaces_its_own_runs_only(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "runs" / "bench-train" / "off-1"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    code = main(["bench", "train", "--steps", "1", "--repeats", "2"])
    _one_line_error(capsys, "off-1: bench train replaces its earlier runs there, but it holds notes.txt, not a "
                            "run's files; move them away", code)
    assert (mine / "notes.txt").read_text() == "mine"
    (mine / "notes.txt").unlink()
    mine.rmdir()
    mine.write_text("mine")
    _one_line_error(capsys, "off-1: bench train replaces its earlier runs there, but this is a file, not a run "
                            "directory", main(["bench", "train", "--steps", "1", "--repeats", "2"]))


def test_bench_train_takes_an_earlier_run_of_its_own_as_replaceable(tmp_path):
    from tailtamer.bench_train import check_replaceable
    from tailtamer.rl.run_dir import RUN_DIRS, RUN_FILES

    run = tmp_path / "sd-0"
    run.mkdir()
    for name in (*RUN_FILES, ".lock", ".summary.json.k3j2_x.tmp"):  # the last: a write a kill left behind
        (run / name).write_text("x")
    for name in (*RUN_DIRS, ".drafter.a8f1"):
        (run / name).mkdir()
    check_replaceable(run)
    (run / ".notes.txt.a1.tmp").write_text("x")  # a temporary of no file of a run's
    with pytest.raises(TailtamerError, match=r"holds \.notes\.txt\.a1\.tmp, not a run's files"):
        check_replaceable(run)


def test_a_pipe_as_the_prompts_file_is_named_for_what_it_is(model_dir, tmp_path, capsys):
    fifo = tmp_path / "p.jsonl"
    os.mkfifo(fifo)
    code = main(["generate", "--model", str(model_dir), "--prompts", str(fifo), "--out", str(tmp_path / "o.jsonl")])
    _one_line_error(capsys, f"{fifo}: not a regular file (a pipe or device)", code)


def test_a_missing_tokenizer_directory_is_named_as_one(tmp_path, capsys):
    code = main(["init-model", "--preset", "tiny", "--tokenizer", str(tmp_path / "none"), "--out", str(tmp_path / "m")])
    _one_line_error(capsys, f"--tokenizer {tmp_path / 'none'}: not a directory (give the one holding tokenizer.json)",
                    code)
    assert not (tmp_path / "m").exists()
