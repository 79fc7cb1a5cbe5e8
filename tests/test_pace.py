"""Step-interleaved benchmark runs (`tailtamer.pace`, `bench train`): arms take turns step by
step, an ordinary run never waits, and a failing arm stops the others with its error."""

import json
import re
import threading
import time

import pytest

import tailtamer.pace as pace_module
from tailtamer.errors import TailtamerError
from tailtamer.pace import NoPace, Pace, turn_of


def test_an_unpaced_run_never_waits():
    pace = NoPace()
    pace.ready()
    pace.wait(7)  # would block forever if it looked for a turn
    pace.done(7, settle=lambda: 1 / 0)  # nothing to settle either
    pace.finish(10)


def test_arms_take_turns_step_by_step(tmp_path, monkeypatch):
    monkeypatch.setattr(pace_module, "POLL_S", 0.001)
    monkeypatch.setattr(pace_module, "SETTLE_S", 0.3)
    (tmp_path / "turn").write_text("0")
    arms, steps, order, lock = 3, 4, [], threading.Lock()
    started, ready_at = {}, []

    def arm(a):
        pace = Pace(f"{tmp_path}:{a}:{arms}")
        time.sleep(0.05 * a)  # set-ups end at different times
        with lock:
            ready_at.append(time.monotonic())
        pace.ready()
        for step in range(steps):
            pace.wait(step)
            with lock:
                order.append((step, a))
                started[step, a] = time.monotonic()
            pace.done(step)
        pace.finish(steps)
        with lock:
            order.append(("finished", a))

    threads = [threading.Thread(target=arm, args=(a,), daemon=True) for a in (2, 0, 1)]  # in any order
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), order
    assert [turn_of(s, a, arms) for s, a in order[: arms * steps]] == list(range(arms * steps))
    assert sorted(order[arms * steps:]) == [("finished", a) for a in range(arms)]  # only after every step
    # the first step settles after the last set-up; later turns follow at once
    assert started[0, 0] - max(ready_at) >= 0.3
    assert started[1, 0] - started[0, arms - 1] < 0.2


def test_paced_train_runs_alternate_and_a_failing_arm_stops_the_other(toy, tmp_path, monkeypatch):
    import contextlib

    import tailtamer.bench_train as bench_train
    from tailtamer.bench_train import run_paced

    pace = tmp_path / "pace"
    pace.mkdir()
    monkeypatch.setattr(bench_train.tempfile, "TemporaryDirectory", lambda **_kw: contextlib.nullcontext(str(pace)))
    out = tmp_path / "runs"
    jobs = {name: toy + ["run.steps=3", f"run.name={name}", "run.save_every=0"] for name in ("a", "b")}
    run_paced(jobs, {name: tmp_path / f"{name}.log" for name in jobs}, timeout_s=300)
    # both arms were set up before the first step, and each of the 6 steps ended its turn in order
    assert (pace / "turn").read_text() == "6" and (pace / "ready-0").exists() and (pace / "ready-1").exists()
    rows = {name: [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
            for name in jobs}
    assert [r["step"] for r in rows["a"]] == [r["step"] for r in rows["b"]] == [1, 2, 3]
    assert [r["reward_mean"] for r in rows["a"]] == [r["reward_mean"] for r in rows["b"]]  # same job, same seeds
    # the first arm fails at start-up: the second, waiting for its turn, is stopped, and the error is one line
    (pace / "turn").write_text("0")
    for ready in pace.glob("ready-*"):
        ready.unlink()
    jobs = {"bad": toy + ["run.name=bad", "rollout.top_p=2"], "good": toy + ["run.steps=3", "run.name=good"]}
    with pytest.raises(TailtamerError, match=r"the bad arm failed .*bad\.log\): error: .*top_p"):
        run_paced(jobs, {name: tmp_path / f"{name}.log" for name in jobs}, timeout_s=300)
    assert not (out / "good" / "metrics.jsonl").exists() or not (out / "good" / "metrics.jsonl").read_text()


def test_a_ctrl_c_to_bench_train_stops_its_arms_as_they_stop_themselves(toy, tmp_path, monkeypatch):
    """The arms were killed outright: a run cut mid-write in each, and the killed launchers'
    leaked-semaphore warnings in their logs. Now each arm gets the trainer's stop at once (two
    Ctrl-Cs) and says so in its log, and bench train says what is left, in one line."""
    import tailtamer.bench_train as bench_train
    from tailtamer.bench_train import run_paced
    from tailtamer.stopping import Interrupted

    out, logs = tmp_path / "runs", {name: tmp_path / f"{name}.log" for name in ("a", "b")}
    jobs = {name: toy + ["run.steps=200", f"run.name={name}", "run.save_every=0"] for name in logs}
    sleep = time.sleep

    def ctrl_c_once_running(seconds):
        metrics = out / "b" / "metrics.jsonl"
        if not ctrl_c_once_running.sent and metrics.exists() and metrics.read_text().count("\n") >= 2:
            ctrl_c_once_running.sent = True
            raise KeyboardInterrupt
        sleep(seconds)

    ctrl_c_once_running.sent = False
    monkeypatch.setattr(bench_train.time, "sleep", ctrl_c_once_running)
    with pytest.raises(Interrupted, match=rf"^stopped by Ctrl-C: bench train's runs in {re.escape(str(tmp_path))} end "
                                          rf"where they were \(the next bench train replaces them\); no report$"):
        run_paced(jobs, logs, timeout_s=300)
    for log in logs.values():
        text = log.read_text()
        assert text.strip().splitlines()[-1].startswith("stopped") and "leaked semaphore" not in text, text


ARM_IN_A_LONG_CALL = """
import torch
from tailtamer.stopping import StopRequest

a = torch.randn(2000, 2000, dtype=torch.float64)
print("ready", flush=True)
try:
    with StopRequest(log=lambda line: print(line, flush=True)) as stop:
        while True:  # never between steps: only a stop at once ends it
            torch.mm(a, a)
except KeyboardInterrupt:
    print("unwound", flush=True)
"""


def test_an_arm_in_a_long_torch_call_gets_both_ctrl_cs(tmp_path, monkeypatch):
    """Two SIGINTs sent 0.2 s apart to an arm inside one long torch call reached its handler as
    one (a stop after the step, where a stop at once was meant): the arm was killed when the
    grace ran out. The second is now sent once the arm has said it heard the first."""
    import subprocess
    import sys

    import tailtamer.bench_train as bench_train

    monkeypatch.setattr(bench_train, "STOP_GRACE_S", 20.0)
    log = tmp_path / "arm.log"
    with open(log, "w") as out:
        arm = subprocess.Popen([sys.executable, "-c", ARM_IN_A_LONG_CALL], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # inside a call
    bench_train._stop({"arm": arm}, {"arm": log})
    assert arm.returncode == 0 and log.read_text().strip().splitlines()[-1] == "unwound", log.read_text()


def test_median_interval_brackets_the_median_and_narrows_with_more_values():
    import random
    import statistics

    from tailtamer.bench_train import median_interval

    rng = random.Random(1)
    few = [1.0 + rng.gauss(0, 0.08) for _ in range(30)]
    many = few + [1.0 + rng.gauss(0, 0.08) for _ in range(270)]
    lo, hi = median_interval(few)
    assert lo <= statistics.median(few) <= hi
    lo2, hi2 = median_interval(many)
    assert lo2 <= statistics.median(many) <= hi2 and hi2 - lo2 < (hi - lo) / 2  # ~1/sqrt(n): 10x the values
    assert median_interval([1.0] * 5) == [1.0, 1.0]
