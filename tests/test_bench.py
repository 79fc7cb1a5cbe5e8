"""The benchmarks' own plumbing, on a tiny random model (their speed is never asserted)."""

import gc

import pytest
import torch

from tailtamer.bench import bench_rollout, seconds_by_running
from tailtamer.errors import ConfigError
from tailtamer.model.drafter import init_drafter, save_drafter
from tailtamer.model.io import load_pretrained
from tailtamer.rollout.engine import Engine
from tailtamer.rollout.speculator import DEFAULT_BUCKET_THRESHOLDS, FUSED_ARMS
from tailtamer.rollout.stats import RolloutStats


def test_bench_rollout_times_every_arm_in_every_run_on_plain_decodings_tokens(model_dir, tmp_path, monkeypatch):
    """Every arm (SD always, the three adaptive engines kept across runs after their warm-up, one
    of them with the fused arms too, and the one with a fresh bandit per run) emits plain decoding's tokens and is timed once per run;
    on a CPU the adaptive switch is unset, and the kept bandits' summaries say they are summed."""
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)  # compiled chains run as eager code here
    model, _ = load_pretrained(model_dir)
    save_drafter(init_drafter(model, std=0.2), tmp_path / "drafter")
    report = bench_rollout(str(model_dir), prompts=4, n=4, repeats=3, max_new_tokens=12, plot=None,
                           drafter_dir=str(tmp_path / "drafter"))
    arms = report["arms"]
    assert list(arms) == ["plain", "sd_fixed_4_2_8", "adaptive", "adaptive_compiled", "adaptive_fused",
                          "adaptive_fresh_bandit"]
    assert all(a["identical_to_plain"] == 1.0 and len(a["speedup_each_run"]) == 3 for a in arms.values())
    assert report["bs_threshold"] is None and report["tail_running"] == 64 and report["requests"] == 16
    assert all("tuner_all_runs" in arms[k] for k in ("adaptive", "adaptive_compiled", "adaptive_fused"))
    fused_arms = {n for b in arms["adaptive_fused"]["tuner_all_runs"]["buckets"] for n in b["pulls"]}
    assert set(FUSED_ARMS) <= fused_arms
    assert "tuner" in arms["adaptive_fresh_bandit"] and "tuner" not in arms["plain"]
    # the kept bandit pulled arms in the warm-up and all three runs: more than the fresh one's one run
    pulls = {k: sum(sum(b["pulls"].values()) for b in arms[k]["tuner_all_runs" if k == "adaptive" else "tuner"]["buckets"])
             for k in ("adaptive", "adaptive_fresh_bandit")}
    assert pulls["adaptive"] > 2 * pulls["adaptive_fresh_bandit"] > 0
    parts = {"prefill", "catch_up", "1-2", "3-64", "65-255", "256+", "other"}
    assert all(set(a["seconds_by_running"]) == parts for a in arms.values())
    catch_up = {k: arms[k]["seconds_by_running"]["catch_up"] for k in ("plain", "sd_fixed_4_2_8")}
    assert catch_up["plain"] == 0 < catch_up["sd_fixed_4_2_8"]
    assert "speedup_by_running" in arms["adaptive"] and "speedup_by_running" not in arms["plain"]
    # drafts by source: EAGLE's alone in the EAGLE arms, none in plain decoding's
    assert arms["plain"]["by_source"] == {} and set(arms["sd_fixed_4_2_8"]["by_source"]) == {"eagle"}
    assert arms["sd_fixed_4_2_8"]["by_source"]["eagle"]["drafted"] > 0


def test_bench_rollout_runs_only_the_arms_asked_for_and_plain(model_dir, tmp_path, monkeypatch):
    """`--arms`: the arms named, in the report's order, beside plain decoding (every ratio's
    baseline), each timed in every run and emitting plain decoding's tokens; the garbage
    collector is paused in each timed run (the warm-ups run as they would) and back after."""
    model, _ = load_pretrained(model_dir)
    save_drafter(init_drafter(model, std=0.2), tmp_path / "drafter")
    collecting = []
    generate = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda *a, **k: collecting.append(gc.isenabled()) or generate(*a, **k))
    report = bench_rollout(str(model_dir), prompts=4, n=4, repeats=2, max_new_tokens=12, plot=None,
                           drafter_dir=str(tmp_path / "drafter"), arms=("adaptive_fresh_bandit", "adaptive"))
    arms = report["arms"]
    assert list(arms) == ["plain", "adaptive", "adaptive_fresh_bandit"]
    assert all(a["identical_to_plain"] == 1.0 and len(a["speedup_each_run"]) == 2 for a in arms.values())
    assert "tuner_all_runs" in arms["adaptive"] and "tuner" in arms["adaptive_fresh_bandit"]
    assert collecting == [True, True] + [False] * 6 and gc.isenabled()  # two kept arms' warm-ups, 2 x 3 runs
    # the timeline drawn is the first adaptive arm's; plain decoding alone needs no drafter
    report = bench_rollout(str(model_dir), prompts=2, n=2, repeats=1, max_new_tokens=4, plot=str(tmp_path / "t.png"),
                           arms=("adaptive_fresh_bandit",), drafter_dir=str(tmp_path / "drafter"))
    assert report["plot"] == str(tmp_path / "t.png") and (tmp_path / "t.png").stat().st_size > 0
    report = bench_rollout(str(model_dir), prompts=2, n=2, repeats=1, max_new_tokens=4, plot=str(tmp_path / "p.png"),
                           arms=("plain",), drafter_dir=str(tmp_path / "nowhere"))
    assert list(report["arms"]) == ["plain"] and "plot" not in report and not (tmp_path / "p.png").exists()
    with pytest.raises(ConfigError, match="arms 'adaptive': give a list of names; bench rollout's arms are plain, "):
        bench_rollout(str(model_dir), arms="adaptive")


def test_a_rollouts_seconds_split_by_running_requests_in_the_bandits_buckets():
    stats = RolloutStats(prefill_s=0.05, catch_up_s=0.01, seconds=2.3)
    for running, seconds in ((1, 0.1), (2, 0.2), (3, 0.3), (64, 0.4), (65, 0.5), (255, 0.25), (256, 0.6)):
        stats.record_step(0.0, seconds, running, "plain", running)
    parts = seconds_by_running(stats, DEFAULT_BUCKET_THRESHOLDS)
    expected = {"prefill": 0.05, "catch_up": 0.01, "1-2": 0.3, "3-64": 0.7, "65-255": 0.75, "256+": 0.6}
    assert parts == pytest.approx({**expected, "other": 2.3 - sum(expected.values())})
    assert list(seconds_by_running(stats, (1, 2, 4)))[2:5] == ["1", "2-3", "4+"]


def test_benchmarks_never_replace_what_is_not_their_own(model_dir, tmp_path, monkeypatch, capsys):
    """bench profile deleted runs/bench-profile/profile whatever it held; bench train's run
    directory as a file, or --out inside it, ended in tracebacks; a rollout's figure that could
    not be written lost the report."""
    from tailtamer.bench_profile import profile_rl
    from tailtamer.bench_train import bench_train
    from tailtamer.cli import main
    from tailtamer.errors import TailtamerError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "bench-profile" / "profile").mkdir(parents=True)
    (tmp_path / "runs" / "bench-profile" / "profile" / "notes.txt").write_text("mine\n")
    with pytest.raises(TailtamerError, match="bench profile replaces its earlier runs there, but it holds notes.txt"):
        profile_rl(2)
    assert (tmp_path / "runs" / "bench-profile" / "profile" / "notes.txt").read_text() == "mine\n"
    (tmp_path / "runs" / "bench-train").write_text("x\n")
    with pytest.raises(TailtamerError, match="runs/bench-train: bench train keeps its runs in this directory, but it "
                                             "is a file"):
        bench_train(1, 1)
    assert main(["bench", "train", "--steps", "1", "--out", "runs/bench-train/sd-0"]) == 2
    assert "would overwrite bench train's runs runs/bench-train" in capsys.readouterr().err
    model, _ = load_pretrained(model_dir)
    save_drafter(init_drafter(model, std=0.2), tmp_path / "drafter")
    (tmp_path / "afile").write_text("x\n")
    report = bench_rollout(str(model_dir), prompts=2, n=2, repeats=1, max_new_tokens=4, plot="afile/t.png",
                           arms=("adaptive_fresh_bandit",), drafter_dir=str(tmp_path / "drafter"))
    assert report["plot"].startswith("not written: afile/t.png") and "adaptive_fresh_bandit" in report["arms"]


def test_decode_tokens_beyond_the_models_context_are_refused(model_dir):
    """The engine stopped at the context while tokens/s counted every token asked for: a ratio
    of 2.79 where 1.07 was measured."""
    from tailtamer.bench import engine_vs_transformers

    context = load_pretrained(model_dir)[0].config.max_position_embeddings
    with pytest.raises(ConfigError, match=rf"--new-tokens {context}: the model's context \({context} tokens, "
                                          rf"config.json max_position_embeddings\) holds {context - 32} after"):
        engine_vs_transformers(model_dir, new_tokens=context)
