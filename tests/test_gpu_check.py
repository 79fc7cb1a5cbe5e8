"""benchmarks/gpu_check.py: it passes on this CPU at its cpu-small scale, with the figures it
promises, and a failing (or crashing) check makes the exit code 1."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, *args, timeout=600):
    out = tmp_path / "report.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - t0
    report = json.loads(out.read_text()) if out.is_file() else None
    assert report is None or json.loads(proc.stdout) == report  # the one JSON on stdout is the file's
    return proc, report, seconds


@pytest.mark.slow
def test_every_check_passes_on_the_cpu_with_the_promised_figures(tmp_path):
    proc, report, seconds = _run(tmp_path, "--skip-train")
    print(f"gpu_check --device cpu --skip-train: {seconds:.1f} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["ok"] is True and report["device"] == "cpu" and report["scale"] == "cpu-small"
    assert report["gpu_name"] is None and report["torch"] == torch.__version__
    assert set(report["checks"]) == {"parity", "lossless_sd", "bench"}
    assert report["skipped"]["rl_steps"] == "--skip-train"
    assert set(report["skipped"]) == {"rl_steps", "vllm"}  # vLLM runs in its own environment
    assert all(c["ok"] is True and c["seconds"] > 0 for c in report["checks"].values())

    parity = report["checks"]["parity"]
    assert set(parity["models"]) == {"qwen2", "qwen3", "llama3"}
    for m in parity["models"].values():
        assert m["ok"] is True and m["positions"] > 0
        assert m["top1_agreement_up_to_ties"] >= 0.98 and m["top1_agreement"] >= 0.98
        assert m["fp32_rel_max_diff"] <= 1e-3 and m["bf16_rel_max_diff"] <= 0.05
        assert 0 < m["hf_bf16_vs_fp32_rel_max_diff"] < 0.1  # bfloat16 did run: it is not float32

    sd = report["checks"]["lossless_sd"]
    assert sd["float64"]["identical"] is True and sd["float64"]["sequence_match_rate"] == 1.0
    assert sd["float64"]["accepted_tokens"] > 0
    assert {(r["drafter"], r["strategy"]) for r in sd["float64"]["runs"]} == {
        (d, s) for d in ("random", "warmed") for s in ("4_1_5", "4_2_8", "4_1_5+s8")} | {
        ("suffix", "s4_1_5"), ("suffix", "s4_2_8")}
    warmed = [r for r in sd["float64"]["runs"] if r["drafter"] == "warmed"]
    assert all(r["accept_len"] > 1.1 for r in warmed)  # accepted paths are exercised
    assert sd["float32"]["token_match_rate"] >= 0.95

    bench = report["checks"]["bench"]
    for batch in ("1", "16"):
        assert bench["plain"]["float32"][batch]["tokens_per_s"] > 0
        assert bench["sd"]["float32"][batch]["sd_step_over_plain_step"] > 0
        assert bench["sd"]["float32"][batch]["accept_len"] >= 1.0
        assert bench["verify_cost"]["float32"][batch]["t8_over_t1"] > 0


def test_a_planted_parity_bug_fails_the_check_and_the_exit_code(tmp_path):
    proc, report, _ = _run(tmp_path, "--checks", "parity", "--inject-fault", "parity")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert report["ok"] is False and report["inject_fault"] == "parity"
    parity = report["checks"]["parity"]
    assert parity["ok"] is False and parity["top1_agreement_up_to_ties_min"] < 0.5
    assert parity["fp32_rel_max_diff_max"] > 0.1


def test_sd_that_is_not_lossless_fails_the_check(tmp_path):
    """The planted bug: SD runs with a corrupted target for one drafter in float64."""
    proc, report, _ = _run(tmp_path, "--checks", "lossless_sd", "--inject-fault", "lossless_sd")
    assert proc.returncode == 1, proc.stderr[-3000:]
    runs = report["checks"]["lossless_sd"]["float64"]["runs"]
    assert report["checks"]["lossless_sd"]["ok"] is False
    assert [r["identical"] for r in runs] == [r["drafter"] != "warmed" for r in runs]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_device_this_machine_lacks_is_exit_code_2(capsys):
    assert _module().main(["--device", "cuda", "--threads", str(torch.get_num_threads())]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err


def test_aggregate_needs_every_check_ok():
    aggregate = _module().aggregate
    assert aggregate({"a": {"ok": True}, "b": {"ok": True}})
    assert not aggregate({})
    assert not aggregate({"a": {"ok": True}, "b": {"ok": False}})
    assert not aggregate({"a": {"ok": True}, "b": {"error": "crashed"}})
    assert not aggregate({"a": {"ok": 1}})  # exactly True


def test_a_failing_or_crashing_check_makes_the_exit_code_1(tmp_path, monkeypatch, capsys):
    gpu_check = _module()

    def crash(*_):
        raise RuntimeError("boom")

    fakes = {"parity": lambda *_: {"ok": True, "figure": 1.0}, "lossless_sd": lambda *_: {"ok": False},
             "bench": crash}
    monkeypatch.setattr(gpu_check, "CHECKS", fakes)
    threads = str(torch.get_num_threads())  # leave this process's thread count alone
    argv = ["--device", "cpu", "--skip-train", "--threads", threads, "--checks"]
    out = tmp_path / "r.json"

    assert gpu_check.main([*argv, "parity,lossless_sd,bench", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    assert report["ok"] is False and report["checks"]["parity"]["ok"] is True
    assert report["checks"]["lossless_sd"]["ok"] is False
    assert report["checks"]["bench"]["ok"] is False and report["checks"]["bench"]["error"] == "RuntimeError: boom"

    assert gpu_check.main([*argv, "parity", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["ok"] is True


def test_rl_metrics_are_judged():
    judge = _module().judge_metrics
    row = {"step": 1, "loss": -0.1, "reward_mean": 0.25, "reward_fn/acc": 1.0}
    assert judge([row] * 3, 3) == (True, [])
    assert not judge([row] * 2, 3)[0]
    assert not judge([row, row, {**row, "loss": float("nan")}], 3)[0]
    assert not judge([row, row, {**row, "loss": None}], 3)[0]
    assert not judge([row, row, {**row, "reward_mean": 1.5}], 3)[0]
    assert not judge([row, row, {**row, "reward_fn/acc": -0.5}], 3)[0]
