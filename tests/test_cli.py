"""The `tailtamer` command line, end to end on a tiny random model."""

import json
import shlex
import shutil
import subprocess
import sys

import pytest

from tailtamer.cli import main


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_generate_writes_rows_and_stats(model_dir, tmp_path):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "12+3=?\n"}), "",
                                            json.dumps({"messages": [{"role": "user", "content": "hi"}]})])
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    code = main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out),
                 "--n", "3", "--max-new-tokens", "8", "--temperature", "0.8", "--top-p", "0.9",
                 "--stats", str(stats)])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(i, j) for i in range(2) for j in range(3)]
    for r in rows:
        assert set(r) == {"prompt_index", "sample_index", "text", "token_ids", "finish_reason"}
        assert 1 <= len(r["token_ids"]) <= 8 and r["finish_reason"] in ("stop", "length")
    s = json.loads(stats.read_text())
    assert s["tokens"] == sum(len(r["token_ids"]) for r in rows)
    assert s["accept_len_mean"] == 1.0 and s["tokens_per_s"] > 0 and s["seconds"] > 0
    assert len(s["timeline"]) == s["decode_steps"]


def test_generate_on_a_full_disk_is_one_line_naming_the_file(model_dir, tmp_path, monkeypatch, capsys):
    import tailtamer.atomic as atomic

    def full_disk(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic, "atomic_write_text", full_disk)
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "12+3=?\n"})])
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"error: cannot write the completions into {out} (No space left on device); " \
                                "nothing was written there"
    assert not out.exists()


def test_generate_says_when_the_context_will_cut_responses(model_dir, tmp_path, capsys):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "12+3=?\n"})])
    argv = ["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
            "--temperature", "0"]
    assert main(argv + ["--max-new-tokens", "8"]) == 0
    assert "context" not in capsys.readouterr().err
    assert main(argv + ["--max-new-tokens", "100000"]) == 0
    err = capsys.readouterr().err
    assert "--max-new-tokens 100000, but the model's context is 256 tokens and prompts take up to 7" in err


def test_generate_is_reproducible_and_greedy_is_deterministic(model_dir, tmp_path):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "5+5=?\n"})])

    def run(*extra):
        out = tmp_path / "o.jsonl"
        assert main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out),
                     "--max-new-tokens", "10", *extra]) == 0
        return out.read_text()

    assert run("--seed", "3", "--n", "4") == run("--seed", "3", "--n", "4")
    assert run("--temperature", "0") == run("--temperature", "0", "--dtype", "float64")


@pytest.mark.parametrize("content,message", [
    ("", "no rows (the file is empty)"),
    ('{"prompt": "a"}\n{"prompt": \n', "p.jsonl:2: not valid JSON"),
    ('{"prompt": "a"}\n[1, 2]\n', "p.jsonl:2: expected a JSON object"),
    ('{"text": "a"}\n', "p.jsonl:1: row has neither 'prompt' nor 'messages' (nor a GSM8K 'question')\n"),
    ('{"prompt": 3}\n', "p.jsonl:1: field 'prompt' must be a string"),
    ('{"prompt": ""}\n', "p.jsonl:1: field 'prompt' is empty"),
    ('{"messages": [{"role": "user"}]}\n', "p.jsonl:1: message 0 needs string fields"),
    ('{"prompt": "a"}\n{"prompt": "' + "x" * 300 + '"}\n', "p.jsonl:2: prompt has 300 tokens; the context holds 256"),
])
def test_bad_prompt_files_name_file_and_row(model_dir, tmp_path, capsys, content, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(content)
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert message in err, err
    assert not out.exists()  # nothing half-written


def test_missing_files_are_clear_errors(model_dir, tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompts", "x", "--out", "y"]) == 2
    assert "nope: model directory not found" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir), "--prompts", str(tmp_path / "none.jsonl"),
                 "--out", "y"]) == 2
    assert "none.jsonl: file not found" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir), "--prompts", str(tmp_path), "--out", "y"]) == 2
    assert f"{tmp_path}: is a directory; give the JSONL or parquet file in it" in capsys.readouterr().err


def test_bad_sampling_flag_is_a_clear_error(model_dir, tmp_path, capsys):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "a"})])
    assert main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", "o",
                 "--top-p", "0"]) == 2
    assert "error: --top-p must be in (0, 1], got 0.0" in capsys.readouterr().err


def test_init_model_and_task_feed_generate(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tmp_path / "m"
    assert main(["init-model", "--preset", "tiny", "--arch", "llama", "--out", str(model)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(model)
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.hidden_size == 128
    prompts = tmp_path / "task.jsonl"
    assert main(["task", "--n", "5", "--out", str(prompts)]) == 0
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert len(rows) == 5 and all(r["prompt"].endswith("=?\n") and r["answer"].isdigit() for r in rows)
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "4"]) == 0
    assert len(out.read_text().splitlines()) == 5


def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "tailtamer", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for command in ("generate", "sft", "init-model", "demo", "bench"):
        assert command in result.stdout


def test_generate_with_speculation_matches_plain(model_dir, tmp_path):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "12+3=?\n"}), json.dumps({"prompt": "7-2=?\n"})])
    drafter = tmp_path / "drafter"
    assert main(["drafter", "train", "--model", str(model_dir), "--data", str(prompts_as_texts(tmp_path)),
                 "--out", str(drafter), "--steps", "5"]) == 0
    assert (drafter / "config.json").is_file() and (drafter / "train.json").is_file()
    # a flag that the --init drafter would override is refused, not dropped
    assert main(["drafter", "train", "--model", str(model_dir), "--data", str(prompts_as_texts(tmp_path)),
                 "--out", str(tmp_path / "again"), "--steps", "1", "--init", str(drafter), "--no-fc-bias"]) == 2
    assert not (tmp_path / "again").exists()
    outputs = {}
    for name, extra in {"plain": [], "eagle": ["--spec", "on", "--drafter", str(drafter), "--strategy", "3_2_6"],
                        "suffix": ["--spec", "on", "--drafter", "suffix"],
                        "fused": ["--spec", "on", "--drafter", str(drafter), "--strategy", "3_1_4+s6"],
                        "arms": ["--spec", "adaptive", "--drafter", "suffix",
                                 "--strategies", "s2_1_3", "s5_1_6"]}.items():
        out, stats = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        assert main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out),
                     "--n", "2", "--max-new-tokens", "20", "--seed", "4", "--stats", str(stats), *extra]) == 0
        outputs[name] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
        s = json.loads(stats.read_text())
        assert {"accept_len_mean", "accept_len_hist", "accept_rate_by_position", "drafted_tokens",
                "accepted_tokens"} <= set(s)
        if name == "arms":  # the bandit drafted with the arms given, and only those
            assert set(s["by_strategy"]) <= {"s2_1_3", "s5_1_6"} and s["sd_steps"] > 0
    assert outputs["plain"] == outputs["eagle"] == outputs["suffix"] == outputs["fused"] == outputs["arms"]


def prompts_as_texts(tmp_path):
    return _write(tmp_path / "texts.jsonl", [json.dumps({"text": "12+3=15\nanswer: 15"})] * 4)


@pytest.mark.parametrize("extra,message", [
    (["--spec", "on"], "--spec on needs a drafter (--drafter): an EAGLE drafter directory, or 'suffix' ('ngram' on "
                       "--backend=vllm)"),
    (["--spec", "on", "--drafter", "ngram"], "--drafter=ngram is vLLM's prompt lookup"),
    (["--spec", "on", "--drafter", "suffix", "--strategy", "4_1_5"], "--strategy 4_1_5: the suffix drafter drafts sD_K_N"),
    (["--spec", "on", "--drafter", "suffix", "--strategy", "8x4"], "--strategy: strategy '8x4' is not DEPTH_TOPK_VERIFY"),
    (["--spec", "adaptive", "--drafter", "suffix", "--bs-threshold", "-1"], "--bs-threshold must be >= 0"),
    (["--spec", "on", "--drafter", "suffix", "--compile"], "--compile compiles an EAGLE drafter's draft chains"),
    # a flag the mode would not read is refused, not dropped
    (["--drafter", "suffix", "--strategy", "s8_2_9"], "--drafter applies to --spec on or adaptive; --spec off"),
    (["--spec", "on", "--drafter", "suffix", "--bs-threshold", "2"], "--bs-threshold applies to --spec adaptive;"),
    (["--spec", "on", "--drafter", "suffix", "--tuner", "beg"], "--tuner applies to --spec adaptive;"),
    (["--spec", "adaptive", "--drafter", "suffix", "--strategy", "s4_1_5"], "--strategy is the one arm of --spec on"),
    (["--spec", "adaptive", "--drafter", "suffix", "--tuner", "fixed", "--strategies", "s4_1_5"],
     "--strategies are the bandit's arms; --tuner fixed drafts --strategy"),
    (["--spec", "adaptive", "--drafter", "suffix", "--strategies", "4_1_5"], "--strategies 4_1_5: the suffix drafter"),
    (["--spec", "on", "--drafter", "suffix", "--strategy", "s4_2_5+s3"], "s4_2_5 is the suffix drafter's arm already"),
    (["--n", "0"], "--n must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
])
def test_bad_speculation_flags(model_dir, tmp_path, capsys, extra, message):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "a"})])
    assert main(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", "o", *extra]) == 2
    assert message in capsys.readouterr().err


def test_drafter_train_bad_data(model_dir, tmp_path, capsys):
    data = _write(tmp_path / "d.jsonl", [json.dumps({"text": "ok"}), json.dumps({"prompt": 1})])
    assert main(["drafter", "train", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "o")]) == 2
    assert "d.jsonl:2: need a string 'text'" in capsys.readouterr().err
    data.write_text(json.dumps({"text": "ok"}) + "\n" + '{"prompt": "a", "response": "b\\ud800"}\n')  # JSON's escape
    assert main(["drafter", "train", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "o")]) == 2
    assert "d.jsonl:2: the text is not valid Unicode (an unpaired surrogate" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_drafter_train_cuts_texts_to_the_targets_context(model_dir, tmp_path, monkeypatch):
    """Texts were cut at drafter training's 512 tokens whatever the target's context: a model of
    a 16-token context was trained on its positions 16 and beyond."""
    import tailtamer.drafter.train as drafter_train

    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    data = _write(tmp_path / "d.jsonl", [json.dumps({"text": "1+2+3+4+5+6+7+8+9=45 " * 4})])
    seen = []

    def capture(model, seqs, cfg, **kwargs):
        seen.extend(seqs)
        raise KeyboardInterrupt  # nothing to train: the sequences are what this test reads

    monkeypatch.setattr(drafter_train, "train_drafter", capture)
    assert main(["drafter", "train", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "o")]) == 130
    assert [len(s) for s in seen] == [16]


def _broken_model(model_dir, tmp_path, how):
    """A copy of the test model broken in one way."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from tailtamer.model.tokenizer import CHAR_SPECIALS, char_tokenizer

    out = tmp_path / f"broken-{how}"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    if how == "eps":
        config["rms_norm_eps"] = "abc"
    elif how == "rope":
        config["rope_scaling"] = "linear"
        config.pop("rope_parameters", None)
    elif how == "eos":
        config["eos_token_id"] = "</s>"
    elif how == "nan":
        tensors = load_file(str(out / "model.safetensors"))
        tensors["model.norm.weight"][0] = float("nan")
        save_file(tensors, str(out / "model.safetensors"))
    elif how in ("float8", "int", "bool"):  # quantized or damaged: the loader copied them into floats
        dtype = {"float8": torch.float8_e4m3fn, "int": torch.int32, "bool": torch.bool}[how]
        tensors = load_file(str(out / "model.safetensors"))
        tensors["model.norm.weight"] = tensors["model.norm.weight"].to(dtype)
        save_file(tensors, str(out / "model.safetensors"))
    elif how == "quantized":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    elif how == "vocab":
        config["vocab_size"] = len(CHAR_SPECIALS) + 10
        tensors = load_file(str(out / "model.safetensors"))
        tensors = {k: (v[: config["vocab_size"]] if v.shape[0] == char_tokenizer().vocab_size else v)
                   for k, v in tensors.items()}
        save_file({k: torch.as_tensor(v).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("how,message", [
    ("eps", "config.json: rms_norm_eps must be a number, got 'abc'"),
    ("rope", "config.json: rope_scaling / rope_parameters must be an object, got 'linear'"),
    ("eos", "config.json: bos_token_id, eos_token_id and pad_token_id must be token ids"),
    ("nan", "model.safetensors: non-finite values (NaN or inf) in 1 tensor(s): norm.weight"),
    ("vocab", "tokenizer.json: 101 token ids but the model's vocab_size is 15"),
    ("float8", "model.safetensors: 1 tensor(s) not of a float dtype tailtamer loads (float32, bfloat16, float16, "
               "float64): norm.weight (float8_e4m3fn); a quantized checkpoint must be dequantized first"),
    ("int", "norm.weight (int32)"),
    ("bool", "norm.weight (bool)"),
    ("quantized", "config.json: a quantized checkpoint (quantization_config: awq); tailtamer trains and rolls out "
                  "float weights"),
])
def test_broken_model_directories_are_one_line_errors(model_dir, tmp_path, capsys, how, message):
    model = _broken_model(model_dir, tmp_path, how)
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "a"})])
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
                 "--temperature", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()


def test_a_training_run_given_as_a_model_names_its_checkpoint(model_dir, tmp_path, capsys):
    """A run directory, its checkpoints directory or checkpoints/latest pointer, or a drafter,
    where a model directory belongs."""
    run = tmp_path / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {name: r}\n")
    (run / "checkpoints" / "latest").write_text("step-000040\n")
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle"]}))
    for given, message in ((run, f"{run} is a training run, not a model; give one of its checkpoints: "
                                 f"{run / 'checkpoints'}/step-N"),
                           (run / "checkpoints" / "latest", f"is the run's pointer to its newest checkpoint; give "
                                                            f"that checkpoint: {run / 'checkpoints' / 'step-000040'}"),
                           (run / "checkpoints", f"holds a run's checkpoints; give one of them: {run / 'checkpoints'}"
                                                 f"/step-N (the newest: {run / 'checkpoints' / 'step-000040'})"),
                           (drafter, f"{drafter} is an EAGLE drafter, not a model: give it as the drafter")):
        assert _generate(given, tmp_path) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.splitlines()) == 1 and message in err, err


def _generate(model_dir, tmp_path, *extra, out=None):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "a"})])
    return main(["generate", "--model", str(model_dir), "--prompts", str(prompts),
                 "--out", str(out or tmp_path / "o.jsonl"), "--max-new-tokens", "2", *extra])


@pytest.mark.parametrize("case,message", [
    ("model-is-a-file", "is a file; a model is a directory"),
    ("device-banana", "--device: 'banana' is not a device"),
    ("device-cuda", "--device: cuda was asked for, but this PyTorch build sees no CUDA GPU"),
    ("out-is-a-dir", "--out {tmp}/outdir is a directory"),
    ("stats-is-a-dir", "--stats {tmp}/outdir is a directory"),
    ("empty-stop", "stop strings must be non-empty"),
    ("bad-utf8", "p8.jsonl:2: not valid UTF-8"),
])
def test_bad_generate_arguments_are_one_line_errors(model_dir, tmp_path, capsys, case, message):
    import torch

    if case == "device-cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    (tmp_path / "outdir").mkdir()
    args = {"model-is-a-file": ["--model-file"], "device-banana": ["--device", "banana"],
            "device-cuda": ["--device", "cuda"], "out-is-a-dir": [], "stats-is-a-dir": ["--stats", str(tmp_path / "outdir")],
            "empty-stop": ["--stop", ""], "bad-utf8": []}[case]
    if case == "model-is-a-file":
        code = _generate(model_dir / "config.json", tmp_path)
    elif case == "out-is-a-dir":
        code = _generate(model_dir, tmp_path, out=tmp_path / "outdir")
    elif case == "bad-utf8":
        bad = tmp_path / "p8.jsonl"
        bad.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n')
        code = main(["generate", "--model", str(model_dir), "--prompts", str(bad), "--out", str(tmp_path / "o.jsonl")])
    else:
        code = _generate(model_dir, tmp_path, *args)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert message.format(tmp=tmp_path) in err, err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("argv,message", [
    (["task", "--n", "-3", "--out", "{tmp}/t.jsonl"], "--n must be >= 1, got -3"),
    (["init-model", "--preset", "tiny", "--out", "{tmp}/file"], "--out {tmp}/file is a file"),
    (["init-model", "--preset", "tiny", "--out", "{tmp}/full"], "--out {tmp}/full already exists and holds config.json;"),
    (["bench", "decode", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["bench", "profile", "--steps", "1"], "--steps must be >= 2 for bench profile, got 1"),
    (["bench", "train", "--set", "spec.mode=off"], "--set spec.mode=off: bench train sets run.steps, run.name"),
    (["bench", "train", "--set", "run.name=mine"], "--set run.name=mine: bench train sets"),
    (["bench", "sd", "--model", "{tmp}/full"], "bench sd --model {tmp}/full needs --drafter DIR, an EAGLE drafter"),
    (["bench", "decode", "--drafter", "{tmp}/full"], "--drafter is for bench sd, rollout, profile, not bench decode"),
    (["bench", "rollout", "--preset", "tiny"], "--preset is for bench decode, not bench rollout"),
    (["bench", "decode", "--set", "rl.lr=1"], "--set is for bench train, not bench decode"),
    (["bench", "sd", "--new-tokens", "8"], "--new-tokens is for bench decode, not bench sd"),
    (["bench", "sd", "--group", "0"], "--group must be >= 1, got 0"),
    (["bench", "sd", "--group", "65"], "--group 65: at most 64, bench sd's largest batch"),
    (["bench", "sd", "--model", "{tmp}/full", "--drafter", "{tmp}/nope"], "--drafter {tmp}/nope: drafter directory not found"),
    (["sft", "--habit-steps", "-1"], "--habit-steps must be >= 0, got -1"),
    (["init-model", "--preset", "tiny", "--out", "{tmp}/file/m"], "--out {tmp}/file/m: a parent of it is a file"),
    (["bench", "train", "--group", "8"], "--group is for bench sd, not bench train"),
    (["bench", "rollout", "--arms", "adaptive", "fast"],
     "--arms fast: bench rollout's arms are plain, sd_fixed_4_2_8, "),
    (["bench", "sd", "--arms", "plain"], "--arms is for bench rollout, not bench sd"),
    (["bench", "rollout", "--arms", "adaptive", "plain", "adaptive"], "--arms names adaptive more than once"),
    (["demo", "--prompts", "0"], "--prompts must be >= 1, got 0"),
    (["train", "--resume", "{tmp}/nope"], "--resume {tmp}/nope: no such directory; give a run's directory"),
    (["train", "--resume", "{tmp}/full"], "--resume {tmp}/full: not a run directory (it has no config.yaml)"),
    (["train", "run.steps=2", "{tmp}/c.yaml"], "is not KEY=VALUE (e.g. rl.lr=1e-6); a config file goes first"),
    (["train", "--set", "rollout.group_size=1"], "rollout.group_size must be >= 2, got 1"),
    (["train", "--help-config", "--set", "run.steps=2"], "--help-config lists the config fields and runs nothing"),
    (["train", "run.steps=2", "--help-config"], "--help-config lists the config fields and runs nothing"),
    (["train", "--help-config", "run.steps=2"], "--help-config takes text or markdown, got 'run.steps=2'; it lists"),
    (["train", "--help-config="], "--help-config takes text or markdown, got ''; it lists"),  # it ran the job
    (["bench", "rollout", "--arms", "plain", "--drafter", "{tmp}/nope"],
     "--drafter: bench rollout --arms plain drafts nothing"),
    (["bench", "profile", "--model", "{tmp}/full", "--drafter", "{tmp}/full", "--steps", "3"],
     "--steps: bench profile --model times decode steps only"),
    (["drafter", "train", "--model", "{tmp}/full", "--data", "builtin", "--out", "{tmp}/d", "--init", "{tmp}/nope"],
     "--init {tmp}/nope: drafter directory not found"),
    (["drafter", "train", "--model", "{tmp}/full", "--data", "builtin", "--out", "{tmp}/d", "--init", "{tmp}/file"],
     "--init {tmp}/file: a file; a drafter is a directory"),
    (["train", "--set", "run.device=cpu:1"], "run.device: 'cpu:1': the CPU is one device, cpu (or cpu:0); use cpu"),
])
def test_bad_arguments_of_other_commands(tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("precious")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and message.format(tmp=tmp_path) in err, err
    assert (tmp_path / "file").read_text() == "precious" and (tmp_path / "full" / "config.json").read_text() == "{}"


@pytest.mark.parametrize("argv", [
    ["drafter", "train", "--model", "{tmp}/full", "--data", "builtin", "--out", "{tmp}/run/drafter"],
    ["init-model", "--preset", "tiny", "--out", "{tmp}/run/checkpoints/step-9"],
    ["demo", "--out", "{tmp}/run/tensorboard"],
])
def test_a_directory_a_run_keeps_is_no_other_commands_output(tmp_path, capsys, argv):
    """A training run writes its drafter, checkpoints and loggers' files at their names in its
    directory, whether or not they exist yet (a run with SD off has no drafter/). A folder of
    the user's with a config.yaml and a metrics.jsonl but no run's .lock is no run."""
    (tmp_path / "full").mkdir()
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.yaml").write_text("mine: 1\n")
    (project / "metrics.jsonl").write_text('{"mine": 1}\n')
    assert main(["task", "--n", "2", "--out", str(project / "summary.json")]) == 0
    capsys.readouterr()
    run = tmp_path / "run"
    shutil.copytree(project, run, ignore=shutil.ignore_patterns("summary.json"))
    (run / ".lock").write_text("123\n")
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    out = argv[argv.index("--out") + 1].format(tmp=tmp_path)
    assert err == f"error: --out {out} is where the training run {run} keeps its own files; give a directory outside " \
                  f"them\n", err
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.yaml", "metrics.jsonl"]


def test_resuming_a_checkpoint_that_is_not_there_says_so(tmp_path, capsys):
    """It was told to write step-7 into checkpoints/latest, which would break the resume."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step-5").mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", ".lock"):
        (run / name).write_text("run: {name: run}\n" if name == "config.yaml" else "")
    missing = run / "checkpoints" / "step-7"
    assert main(["train", "--resume", str(missing)]) == 2
    assert capsys.readouterr().err == f"error: --resume {missing}: no such directory; give a run's directory, e.g. " \
                                      f"runs/default\n"
    assert main(["train", "--resume", str(run / "checkpoints" / "step-5")]) == 2
    assert "to resume from step-5, write its name into" in capsys.readouterr().err


def test_a_reader_that_closes_the_pipe_early_gets_no_traceback(tmp_path):
    """`tailtamer train --help-config | head -c0`: the reader is gone before the listing is
    written; the command ends as a process ended by SIGPIPE, with nothing on stderr."""
    reader_gone = subprocess.run(f"{shlex.quote(sys.executable)} -m tailtamer train --help-config | head -c0; "
                                 f"exit ${{PIPESTATUS[0]}}", shell=True, executable="/bin/bash", capture_output=True,
                                 text=True, timeout=120)
    assert reader_gone.returncode == 141 and reader_gone.stderr == "", reader_gone


def test_an_interrupted_init_model_leaves_nothing_to_trip_on(tmp_path, monkeypatch):
    """Interrupted between the weights and the tokenizer: no half-filled --out (nor a hidden
    sibling) is left, so the same command then succeeds."""
    from tailtamer.model.tokenizer import Tokenizer

    def interrupted(self, out_dir):
        raise KeyboardInterrupt

    out = tmp_path / "models" / "tiny"
    argv = ["init-model", "--preset", "tiny", "--out", str(out)]
    with monkeypatch.context() as m:
        m.setattr(Tokenizer, "save", interrupted)
        assert main(argv) == 130
    assert not (tmp_path / "models").exists()  # no hidden sibling, no empty --out or parent left
    assert main(argv) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}


def test_a_failed_command_leaves_no_empty_directories_it_created(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    for out in (tmp_path / "new" / "deep" / "model", tmp_path / "mine" / "model"):  # no tokenizer.json in mine
        assert main(["init-model", "--preset", "tiny", "--out", str(out), "--tokenizer", str(tmp_path / "mine")]) == 2
    assert "tokenizer.json not found" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("argv,message", [(["task", "--out", ""], "--out is empty; give a file path"),
                                          (["init-model", "--preset", "tiny", "--out", ""],
                                           "--out is empty; give a directory to create")])
def test_an_empty_output_path_is_named(argv, message, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_a_benchmarks_first_run_says_its_preparation_on_stderr(monkeypatch, capsys):
    """On a fresh machine `bench train` trains the base model and its drafter first (minutes):
    it says so on stderr, as `make demo` does, and stdout keeps only the report."""
    import tailtamer.sft as sft

    def training(cfg, log=print):  # what a first run's SFT says, then a stop: nothing is trained here
        log(f"training the base model into base-{cfg.preset} (cached for later runs)")
        raise KeyboardInterrupt

    monkeypatch.setattr(sft, "ensure_base_model", training)
    for argv in (["bench", "train"], ["bench", "sd"]):
        assert main(argv) == 130  # stopped as by Ctrl-C, before anything ran
        out, err = capsys.readouterr()
        assert "training the base model into base-base" in err and not out


def test_bench_sd_runs_a_grouped_workload_beside_the_single_one(model_dir, tmp_path):
    """GRPO's shape: problems × siblings, where the suffix index reads the siblings' text;
    every arm's output identical to plain decoding on both workloads."""
    from tailtamer.bench import bench_sd
    from tailtamer.model.drafter import init_drafter, save_drafter
    from tailtamer.model.io import load_model

    save_drafter(init_drafter(load_model(model_dir), std=0.2), tmp_path / "drafter")
    report = bench_sd(str(model_dir), batches=(2,), strategies=("2_1_3",), new_tokens=8,
                      drafter_dir=str(tmp_path / "drafter"), group=4)
    assert [(r["group"], r["drafter"]) for r in report["rows"]] == [
        (g, d) for g in (1, 4) for d in ("eagle 2_1_3", "suffix s8_2_9", "fused 4_1_5+s8", "fused 6_1_7+s8")]
    assert all(r["identical_outputs"] == 1.0 for r in report["rows"])
    # each arm's drafts by source: EAGLE's only from the EAGLE drafter, none of them from the suffix drafter
    sources = {r["drafter"]: set(r["by_source"]) for r in report["rows"]}
    assert sources["eagle 2_1_3"] == {"eagle"} and "eagle" not in sources["suffix s8_2_9"]


def test_sigterm_stops_a_command_as_ctrl_c_does(tmp_path):
    """SIGTERM (a scheduler's stop) ended `sft` where it stood: no message, and an empty --out
    and a hidden half-written sibling left behind. It now stops after the step, as a Ctrl-C
    does, and saves its state beside --out for the same command to go on from."""
    import os
    import signal

    out = tmp_path / "models" / "m"
    proc = subprocess.Popen([sys.executable, "-m", "tailtamer", "sft", "--preset", "tiny", "--steps", "100000",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    while not proc.stdout.readline().startswith("sft step"):  # into the training (it prints its first step)
        assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    saved = [p.name for p in (tmp_path / "models").iterdir()]
    assert len(saved) == 1 and saved[0].startswith("m.partial-"), saved  # no empty --out, no hidden sibling
    assert last.startswith("stopped by SIGTERM after step ") and "of the base model's training; saved in " \
        f"{tmp_path / 'models' / saved[0]}: the same command goes on from there" in last, err


@pytest.mark.parametrize("args", [["generate", "--model=", "--prompts", "p", "--out", "o"],
                                  ["generate", "--model", "m", "--prompts=", "--out", "o"],
                                  ["generate", "--model", "m", "--prompts", "p", "--out", "o", "--spec", "on",
                                   "--strategy="],
                                  ["drafter", "train", "--model", "m", "--data", "d", "--out", "o", "--init="],
                                  ["init-model", "--preset", "tiny", "--out", "o", "--tokenizer="],
                                  ["sft", "--out="], ["sft", "--preset="], ["bench", "decode", "--preset="],
                                  ["generate", "--model", "m", "--prompts", "p", "--out", "o", "--stats="]])
def test_an_empty_path_or_name_is_refused(args, tmp_path, capsys, monkeypatch):
    """`--model=` read as the current directory (and was blamed for --out's clash with it);
    `--init=`, `--tokenizer=`, `--strategy=`, `--stats=` and `--preset=` were dropped for their
    defaults, and `sft --out=` trained into the cache."""
    monkeypatch.chdir(tmp_path)
    flag = next(a for a in args if a.endswith("="))
    with pytest.raises(SystemExit) as stop:  # argparse's own exit
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert f"argument {flag[:-1]}: empty; give a value" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args", [["sft", "--preset", "huge"], ["init-model", "--preset", "huge", "--out", "o"],
                                  ["bench", "decode", "--preset", "huge"]])
def test_an_unknown_preset_is_named_with_the_presets(args, tmp_path, capsys, monkeypatch):
    """init-model's and bench's --preset said only 'unknown model preset', as a config error."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert "argument --preset: 'huge': unknown; choose one of base, base-vllm, " in err, err
    assert not any(tmp_path.iterdir())
