"""The RL step end to end on a toy task, resume determinism (also after SIGKILL), and faults."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tailtamer.config import load_train_config
from tailtamer.rl.batching import response_batch
from tailtamer.rl.trainer import train

TIME_FIELDS = {"rollout_s", "rollout_tail_s", "train_s", "step_s", "idle_worker_s", "drafter_train_s", "drafter_preempt_s",
               "compile_s", "timeline"}


def _rows(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(rows):
    return [{k: v for k, v in r.items() if k not in TIME_FIELDS} for r in rows]


def test_grpo_raises_reward_on_a_toy_task(toy, tmp_path):
    summary = train(load_train_config(None, toy + ["run.steps=20", "rl.lr=3e-3", "run.name=learn"]), log=lambda _: None)
    rows = _rows(tmp_path / "runs" / "learn")
    assert len(rows) == 20
    first = sum(r["reward_mean"] for r in rows[:4]) / 4
    last = sum(r["reward_mean"] for r in rows[-4:]) / 4
    print(f"toy reward: first steps {first:.2f}, last steps {last:.2f}")
    assert last > first + 0.2, (first, last)
    assert summary["accuracy_last_steps"] > summary["accuracy_first_steps"]
    run = tmp_path / "runs" / "learn"
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file() and (run / "curves.png").is_file()
    for field in ("step", "reward_mean", "accuracy", "response_len_mean", "response_len_p50", "response_len_max",
                  "rollout_s", "train_s", "step_s", "sd_tokens_frac", "accept_len_mean", "drafter_loss", "drafter_train_s", "idle_worker_s",
                  "compile_s"):
        assert field in rows[0]
    # no drafter runs in the toy job: its fields are null, and no logger gets them
    assert all(rows[0][k] is None for k in rows[0] if k.startswith("drafter_"))


@pytest.mark.slow
def test_the_default_job_raises_held_out_accuracy(tmp_path):
    """The built-in base model mostly answers without working; 12 steps of the default job
    (one worker, plain decoding) teach it to work problems out, which the held-out greedy
    accuracy shows (README: 40 steps of the default job go from 22% to 56-67% over seeds)."""
    cfg = load_train_config(None, [f"run.out_dir={tmp_path}", "run.steps=12", "run.eval_every=12", "run.workers=1",
                                   "spec.mode=off", "run.save_every=0"])
    summary = train(cfg, log=lambda _: None)
    rows = _rows(tmp_path / "default")
    print(f"held-out greedy accuracy {summary['eval_accuracy_start']:.3f} -> {summary['eval_accuracy_end']:.3f}")
    assert summary["eval_accuracy_end"] > summary["eval_accuracy_start"] + 0.15
    length = [sum(r["response_len_mean"] for r in part) / len(part) for part in (rows[:3], rows[-3:])]
    assert length[1] > length[0], length  # working it out takes more tokens


def test_resume_repeats_an_uninterrupted_run(toy, tmp_path):
    # 3 of the 4 prompts per step: the resume falls inside the second pass over the data.
    toy = toy + ["rollout.prompts_per_step=3", "run.log_samples_every=1"]
    straight = toy + ["run.steps=4", "run.save_every=2", "rl.lr=1e-3"]
    train(load_train_config(None, straight + ["run.name=a"]), log=lambda _: None)
    train(load_train_config(None, toy + ["run.steps=2", "run.save_every=2", "rl.lr=1e-3", "run.name=b"]),
          log=lambda _: None)
    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    # Continue b to 4 steps from its checkpoint (steps is the one field a resume may change).
    train(load_train_config(b / "config.yaml", ["run.steps=4"]), resume=b, log=lambda _: None)
    assert _comparable(_rows(b)) == _comparable(_rows(a))
    assert [r["epoch"] for r in _rows(a)] == [0.75, 1.5, 2.25, 3.0]
    prompts = [[x["prompt"] for x in json.loads(f"[{','.join((run / 'samples.jsonl').read_text().splitlines())}]")]
               for run in (a, b)]
    assert prompts[0] == prompts[1] and len(prompts[0]) == 12
    assert sorted(prompts[0][:4]) == ["ab", "cd", "ef", "gh"]  # every prompt once before any twice


def test_sigkill_mid_run_leaves_a_valid_checkpoint(toy, tmp_path):
    args = toy + ["run.steps=60", "run.save_every=2", "rl.lr=1e-3", "run.name=killed", "run.workers=1"]
    run = tmp_path / "runs" / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "tailtamer", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "metrics.jsonl").is_file() or len(_rows(run)) < 5:
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert (run / "checkpoints" / latest / "model.safetensors").is_file()
    steps = max(8, int(latest.removeprefix("step-")) + 2)  # a loaded machine may have run past step 8
    train(load_train_config(run / "config.yaml", [f"run.steps={steps}"]), resume=run, log=lambda _: None)
    train(load_train_config(None, toy + [f"run.steps={steps}", "run.save_every=2", "rl.lr=1e-3", "run.name=whole"]),
          log=lambda _: None)
    assert _comparable(_rows(run)) == _comparable(_rows(tmp_path / "runs" / "whole"))


def test_response_mask_marks_positions_predicting_response_tokens():
    from types import SimpleNamespace

    batch = [{"prompt_ids": [5, 6, 7]}]
    completions = [SimpleNamespace(prompt_index=0, token_ids=[8, 9])]
    ids, mask = response_batch(batch, completions, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9]]
    # logits at positions 2 and 3 predict tokens 8 and 9.
    assert mask.tolist() == [[False, False, True, True]]


def test_nonfinite_losses_stop_the_run_with_a_checkpoint(toy, tmp_path, monkeypatch):
    import tailtamer.rl.grpo as grpo
    from tailtamer.rl.trainer import TrainingError

    monkeypatch.setattr(grpo, "clipped_policy_loss",
                        lambda *a, **k: (a[0] * float("nan"), a[0] > 0))
    with pytest.raises(TrainingError, match="non-finite losses"):
        train(load_train_config(None, toy + ["run.steps=10", "run.name=nan", "run.max_bad_steps=2"]),
              log=lambda _: None)
    run = tmp_path / "runs" / "nan"
    assert (run / "checkpoints" / "latest").is_file()


def test_micro_batching_does_not_change_the_update(toy, tmp_path):
    """Gradient accumulation over micro-batches gives the update of one big forward, for every
    loss aggregation (the token weights are computed over the whole minibatch)."""
    import torch

    from tailtamer.rl.run_state import setup
    from tailtamer.rl.trainer import rl_step

    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        grads = []
        for micro, tokens in ((1, 4096), (3, 4096), (32, 4096), (32, 20)):  # 20 tokens: 2-3 samples each
            cfg = load_train_config(None, toy + ["rl.minibatches=1", f"rl.micro_batch_size={micro}", "rl.lr=1e-2",
                                                 f"rl.micro_batch_tokens={tokens}", f"rl.loss_agg={agg}",
                                                 "rollout.max_new_tokens=6"])
            s = setup(cfg, log=lambda _: None)
            rl_step(s)
            # One minibatch: .grad still holds the step's accumulated (clipped) gradient.
            grads.append(torch.cat([p.grad.flatten() for p in s.model.parameters()]))
        assert grads[0].abs().max() > 1e-4, agg
        for g in grads[1:]:
            assert torch.allclose(g, grads[0], rtol=1e-4, atol=1e-7), agg


def test_the_on_policy_minibatch_takes_its_old_log_probs_from_the_update(toy, monkeypatch):
    """The first minibatch's π_old is the update forward's own π (no optimizer step has run
    yet), so `old_log_probs` skips it; every loss call of the update, over two PPO epochs,
    still sees the π_old a separate no-grad forward before the update gives."""
    import torch

    from tailtamer.rl import grpo, trainer
    from tailtamer.rl.run_state import setup
    from tailtamer.rl.trainer import rl_step

    expected, seen = [], []
    skipping, loss = trainer.old_log_probs, grpo.POLICY_LOSSES["ppo-clip"]

    def checked(s, samples, plan):
        old, ref = skipping(s, samples, plan)
        assert set(old) == {m.key for mb in plan[1:] for m in mb}  # no forward for the first minibatch
        with torch.no_grad():
            for _ in range(s.cfg.rl.ppo_epochs):
                for m in (m for mb in plan for m in mb):
                    ids = samples.ids[m.rows, : m.width]
                    expected.append(grpo.token_log_probs(s.model(ids)[0][:, :-1], ids[:, 1:], 1.0))
        return old, ref

    def spy(logp, old, *args):
        seen.append(old.clone())
        return loss(logp, old, *args)

    monkeypatch.setattr(trainer, "old_log_probs", checked)
    monkeypatch.setitem(grpo.POLICY_LOSSES, "ppo-clip", spy)
    cfg = load_train_config(None, toy + ["rl.minibatches=2", "rl.ppo_epochs=2", "rl.lr=1e-2",
                                         "rollout.max_new_tokens=6"])
    rl_step(setup(cfg, log=lambda _: None))
    assert len(seen) == len(expected) >= 4
    for a, b in zip(seen, expected):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_micro_batches_respect_the_token_budget():
    import torch

    from tailtamer.rl.batching import Samples, needed_width, update_plan
    from tailtamer.rl.grpo import token_mean

    mask = torch.zeros(10, 99, dtype=torch.bool)
    for i, n in enumerate([5, 90, 7, 6, 95, 8, 4, 5, 60, 9]):
        mask[i, 2: 2 + n] = True
    samples = Samples(torch.zeros(10, 100, dtype=torch.long), mask, torch.ones(10, dtype=torch.bool),
                      torch.zeros(10), torch.arange(10))
    plan = update_plan(samples, 10, 2, 4, 200, 99, token_mean, torch.Generator().manual_seed(0))
    assert len(plan) == 2
    rows = [int(r) for mb in plan for m in mb for r in m.rows]
    assert sorted(rows) == list(range(10))
    for micro in (m for mb in plan for m in mb):
        assert len(micro.rows) <= 4 and (len(micro.rows) == 1 or len(micro.rows) * micro.width <= 200)
        assert micro.width == int(needed_width(mask)[micro.rows].max())
    for minibatch in plan:  # token-mean weights of each minibatch sum to one
        assert torch.allclose(sum(m.weights.sum() for m in minibatch), torch.tensor(1.0))


def test_minibatches_do_not_depend_on_how_samples_are_split_over_workers():
    """Minibatch membership is a function of the sample's global index: two workers holding
    any split of the samples form the same minibatches as one worker holding them all."""
    import torch

    from tailtamer.rl.batching import minibatch_of

    whole = minibatch_of(torch.arange(64), 64, 4, torch.Generator().manual_seed(3))
    for part in (torch.tensor([5, 0, 63, 17]), torch.arange(32, 64)):
        assert torch.equal(minibatch_of(part, 64, 4, torch.Generator().manual_seed(3)), whole[part])
    assert sorted(torch.bincount(whole).tolist()) == [16, 16, 16, 16]


def test_tensorboard_logger_without_the_package_is_a_startup_error(toy, monkeypatch):
    import importlib.util

    from tailtamer.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"run.loggers.*pip install \"tailtamer\[tensorboard\]\", or tensorboard"):
        train(load_train_config(None, toy + ["run.loggers=[tensorboard]"]), log=lambda _: None)
    with pytest.raises(ConfigError, match="unknown logger 'mlflow'"):
        train(load_train_config(None, toy + ["run.loggers=[mlflow]"]), log=lambda _: None)


def test_tensorboard_and_wandb_receive_every_step(toy, tmp_path, monkeypatch):
    """TensorBoard for real; W&B through a stand-in module (a real run needs its service),
    which must be started offline unless WANDB_MODE says otherwise."""
    import importlib.machinery
    import types

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged, started = [], {}
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    def init(**kw):  # a W&B service that resumes a run it knows, at the step after its last
        resumed = kw.get("resume") == "allow" and kw["id"] == started.get("id")
        started.update(kw)
        return types.SimpleNamespace(log=lambda row, step: logged.append((step, row)), resumed=resumed,
                                     step=max(s for s, _ in logged) + 1 if resumed else 0,
                                     finish=lambda: started.update(finished=True))

    fake.init = init
    fake.Table = lambda columns, data: {"columns": columns, "data": data}
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    train(load_train_config(None, toy + ["run.steps=3", "run.save_every=2", "run.loggers=[tensorboard,wandb]",
                                         "run.name=loggers"]),
          log=lambda _: None, console=lambda _: None)
    run = tmp_path / "runs" / "loggers"
    rewards = [r["reward_mean"] for r in _rows(run)]
    assert started["mode"] == "offline" and started["finished"] and started["name"] == "loggers"
    assert [(step, row["reward/reward_mean"]) for step, row in logged if "reward/reward_mean" in row] == list(zip([1, 2, 3], rewards))
    tables = [(step, row["rollout/samples"]) for step, row in logged if "rollout/samples" in row]
    assert [step for step, _ in tables] == [1] and tables[0][1]["columns"] == ["prompt", "response", "reward", "length"]
    assert len(tables[0][1]["data"]) == 4  # the first sample of each of the step's 4 prompts
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    scalars = events.Scalars("reward/reward_mean")
    assert [e.step for e in scalars] == [1, 2, 3]
    assert [e.value for e in scalars] == pytest.approx(rewards)
    assert "rollout/samples/text_summary" in events.Tags()["tensors"]
    tags = set(events.Tags()["scalars"])
    assert {"time/step_s", "rollout/response_len_mean", "train/loss", "reward/accuracy"} <= tags
    assert not any(t.startswith("drafter/") for t in tags)  # no drafter in the toy job
    # killed after step 3 with its checkpoint of step 2: the resume logs step 3 again, once
    shutil.rmtree(run / "checkpoints" / "step-000003")
    (run / "checkpoints" / "latest").write_text("step-000002\n")
    first_id, before = started["id"], len(logged)
    monkeypatch.setenv("WANDB_MODE", "online")  # W&B resumes only online runs
    train(load_train_config(run / "config.yaml", ["run.steps=4"]), resume=run, log=lambda _: None, console=lambda _: None)
    scalars = EventAccumulator(str(run / "tensorboard")).Reload().Scalars("reward/reward_mean")
    assert [e.step for e in scalars] == [1, 2, 3, 4]
    assert [e.value for e in scalars] == pytest.approx([r["reward_mean"] for r in _rows(run)])
    # the same W&B run goes on; step 3, which it holds, is not sent again
    assert started["id"] == first_id and started["resume"] == "allow" and started["mode"] == "online"
    assert sorted({step for step, _ in logged[before:]}) == [4]


def test_what_the_reward_prints_goes_to_the_run_directory(toy, tmp_path, capfd):
    reward = tmp_path / "loud_reward.py"
    reward.write_text("def loud(response, answer):\n    print('scored', repr(response))\n    return 0.0\n")
    lines = []
    train(load_train_config(None, toy + [f"rl.reward={reward}:loud", "run.steps=1", "run.name=loud"]),
          log=lines.append, console=lines.append)
    run = tmp_path / "runs" / "loud"
    printed = (run / "reward.log").read_text().splitlines()
    assert len(printed) == 32 and all(line.startswith(("scored '", 'scored "')) for line in printed)  # 4 prompts x 8
    assert any(line.endswith(f"loud prints goes to {run / 'reward.log'}") for line in lines)
    assert "scored" not in capfd.readouterr().err


def test_a_run_that_fails_in_its_first_step_keeps_what_its_reward_printed(toy, tmp_path):
    """Its directory is removed (its name stays free) but for reward.log, which may say why."""
    from tailtamer.errors import ConfigError
    from tailtamer.rl.trainer import TrainingError

    reward = tmp_path / "broken_reward.py"
    reward.write_text("def broken(response, answer):\n    print('parsing', repr(answer))\n    raise ValueError(answer)\n")
    cfg = load_train_config(None, toy + [f"rl.reward={reward}:broken", "run.steps=1", "run.name=broken"])
    with pytest.raises(TrainingError, match="every reward of step 1 failed"):
        train(cfg, log=lambda _: None, console=lambda _: None)
    run = tmp_path / "runs" / "broken"
    assert sorted(p.name for p in run.iterdir()) == [".lock", "reward.log"]
    assert (run / "reward.log").read_text().splitlines()[0] == "parsing '0'"
    train(load_train_config(None, toy + ["run.steps=1", "run.name=broken"]), log=lambda _: None, console=lambda _: None)
    assert len(_rows(run)) == 1 and (run / "reward.log").read_text() == ""  # the name was free; the old log gone
    mine = tmp_path / "runs" / "mine"  # a directory of the user's that holds a file of that name is not ours
    mine.mkdir()
    (mine / "reward.log").write_text("my notes")
    with pytest.raises(ConfigError, match="runs/mine is a directory of other files, not a run"):
        train(load_train_config(None, toy + ["run.steps=1", "run.name=mine"]), log=lambda _: None, console=lambda _: None)
    assert [p.name for p in mine.iterdir()] == ["reward.log"] and (mine / "reward.log").read_text() == "my notes"


def test_an_empty_or_unreadable_wandb_id_gets_a_new_one(tmp_path, monkeypatch):
    import importlib.machinery
    import types

    from tailtamer.metrics import WandbLogger

    started = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: started.append(kw["id"]) or types.SimpleNamespace(resumed=False)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for content in (b"", b"\n", b"\xff\xfe"):
        (tmp_path / "wandb-id").write_bytes(content)
        WandbLogger(tmp_path, {}, 0)
        assert started[-1] and (tmp_path / "wandb-id").read_text() == started[-1] + "\n"
    WandbLogger(tmp_path, {}, 2)
    assert started[-1] == started[-2]  # a readable id is kept


def test_samples_log_shows_what_the_model_wrote(toy, tmp_path):
    import importlib.util

    train(load_train_config(None, toy + ["run.steps=4", "run.log_samples_every=2", "run.name=samples"]),
          log=lambda _: None, console=lambda _: None)
    run = tmp_path / "runs" / "samples"
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in samples] == [1] * 4 + [2] * 4 + [4] * 4  # the first step, then every 2nd
    spec = importlib.util.spec_from_file_location("toy_reward", tmp_path / "toy_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for x in samples:
        assert x["reward"] == module.odd_first_char(x["response"], "0")
        assert x["prompt"] in {"ab", "cd", "ef", "gh"} and 0 <= x["length"] <= 3
    assert all("samples" not in row for row in _rows(run))  # metrics.jsonl stays one line of numbers per step


def test_adaptive_drafter_trains_in_the_window_and_is_checkpointed(toy, model_dir, tmp_path):
    from tailtamer.model.drafter import init_drafter, load_drafter, save_drafter, weights_checksum
    from tailtamer.model.io import load_model

    drafter_dir = tmp_path / "drafter"
    save_drafter(init_drafter(load_model(model_dir), seed=3), drafter_dir)
    start_sha = weights_checksum(load_drafter(drafter_dir, load_model(model_dir)))
    cfg = load_train_config(None, toy + ["run.steps=3", "run.name=spot", "run.save_every=3", "spec.mode=on",
                                         f"spec.drafter={drafter_dir}", "spec.strategy=2_1_3",
                                         "spot.single_worker=window", "spot.window_s=5", "spot.max_steps=3",
                                         "spot.tokens_per_step=64"])
    train(cfg, log=lambda _: None, console=lambda _: None)
    rows = _rows(tmp_path / "runs" / "spot")
    assert all(r["drafter_steps"] == 3 and r["drafter_loss"] > 0 for r in rows)
    shas = [r["drafter_sha"] for r in rows]
    assert len({start_sha, *shas}) == 4  # a new drafter after every step, and the engine ran it (checked)
    saved = tmp_path / "runs" / "spot" / "checkpoints" / "step-000003" / "drafter"
    assert weights_checksum(load_drafter(saved, load_model(saved.parent))) == shas[-1]


def test_compile_time_is_reported_in_the_step_it_was_spent(toy, model_dir, tmp_path, monkeypatch):
    """spec.compile's time (here a compile that takes 0.3 s and fails, so chains run eager)
    is in `compile_s` of the step that paid it, inside its rollout_s, and 0 afterwards (8
    requests: chains of at most 8 compile)."""
    import time

    import torch

    from tailtamer.model.drafter import init_drafter, save_drafter
    from tailtamer.model.io import load_model

    def slow_failure(*_args, **_kwargs):
        time.sleep(0.3)
        raise RuntimeError("no compiler")
    monkeypatch.setattr(torch, "compile", lambda fn, **_kw: slow_failure)
    drafter_dir = tmp_path / "drafter"
    save_drafter(init_drafter(load_model(model_dir), seed=3), drafter_dir)
    cfg = load_train_config(None, toy + ["run.steps=2", "run.name=compiled", "rollout.group_size=2", "spec.mode=on",
                                         "spec.compile=true", f"spec.drafter={drafter_dir}", "spec.strategy=2_1_3",
                                         "spot.single_worker=never"])
    train(cfg, log=lambda _: None, console=lambda _: None)
    first, second = _rows(tmp_path / "runs" / "compiled")
    assert 0.3 <= first["compile_s"] <= first["rollout_s"] and second["compile_s"] == 0.0


def test_drafter_window_never_leaves_the_drafter_as_it_was(toy, model_dir, tmp_path):
    from tailtamer.model.drafter import init_drafter, save_drafter
    from tailtamer.model.io import load_model

    drafter_dir = tmp_path / "drafter"
    save_drafter(init_drafter(load_model(model_dir), seed=3), drafter_dir)
    cfg = load_train_config(None, toy + ["run.steps=2", "run.name=never", "spec.mode=on", f"spec.drafter={drafter_dir}",
                                         "spec.strategy=2_1_3", "spot.single_worker=never"])
    train(cfg, log=lambda _: None, console=lambda _: None)
    rows = _rows(tmp_path / "runs" / "never")
    assert "drafter_steps" not in rows[0] and rows[0]["drafter_sha"] == rows[1]["drafter_sha"]


def test_the_drafter_learns_from_every_response_whatever_the_policy_loss_keeps(toy, model_dir, tmp_path):
    """Overlong masking drops the truncated (longest) responses from the policy loss, dynamic
    sampling drops agreeing groups, and the update skips samples of advantage 0 (here every
    sample with the zero reward); the DataBuffer still gets every response with a training
    pair, from the rollout's own forwards. The strategy's depth 4 exceeds these 3-token
    responses, which the accept-length estimate used to crash on."""
    from tailtamer.model.drafter import init_drafter, save_drafter
    from tailtamer.model.io import load_model
    from tailtamer.rl.run_state import prepare, setup
    from tailtamer.rl.trainer import rl_step

    drafter_dir = tmp_path / "drafter"
    save_drafter(init_drafter(load_model(model_dir), seed=3), drafter_dir)
    zero = tmp_path / "zero.py"
    zero.write_text("def zero(response, answer):\n    return 0.0\n")
    for extra in (["rl.overlong=mask"], ["rl.dynamic_sampling=true", f"rl.reward={zero}:zero"]):
        cfg = load_train_config(None, toy + extra + ["spec.mode=on", f"spec.drafter={drafter_dir}",
                                                     "spec.strategy=4_2_8", "spot.single_worker=window",
                                                     "spot.window_s=0"])
        s = setup(prepare(cfg), log=lambda _: None)
        row = rl_step(s)
        assert row["kept_groups_frac"] < 0.5, extra
        with_pairs = sum(n >= 2 for n in row["lengths"])  # a first token that is EOS gives none
        assert with_pairs > 16 and len([e for e in s.drafter.buffer.entries if e.step == 0]) == with_pairs, extra
        assert row["accept_len_est"] >= 1.0
        s.scorer.close()


def test_micro_batch_cuts_minimise_padding_plus_call_cost():
    import itertools

    from tailtamer.token_budget import token_budget_chunks

    widths = [40, 36, 190, 44, 38, 120, 41, 39, 37, 300, 42, 35]

    def cost(chunks, overhead):
        return sum(overhead + len(c) * max(widths[i] for i in c) for c in chunks)

    chunks = token_budget_chunks(widths, max_rows=8, max_tokens=4096, overhead=64)
    assert sorted(i for c in chunks for i in c) == list(range(len(widths)))
    assert all(len(c) <= 8 for c in chunks)
    # the long rows do not pad the short ones, and the optimum beats every cut of the sorted
    # widths into contiguous chunks (exhaustive over the 2^11 cut sets)
    assert max(widths[i] for i in chunks[0]) <= 44
    order = sorted(range(len(widths)), key=lambda i: (widths[i], i))
    best = min(cost([order[a:b] for a, b in zip((0,) + cuts, cuts + (len(order),))], 64)
               for k in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), k)
               if all(b - a <= 8 for a, b in zip((0,) + cuts, cuts + (len(order),))))
    assert cost(chunks, 64) == best
    # a huge per-call cost puts everything that fits into as few chunks as possible
    assert len(token_budget_chunks(widths, max_rows=16, max_tokens=10**6, overhead=10**6)) == 1


def test_logger_tags_group_the_metrics():
    from tailtamer.metrics import tag

    assert [tag(k) for k in ("reward_mean", "eval_accuracy", "reward_fn/long", "response_len_p50", "accept_len_mean",
                             "accept_len_est_frozen", "drafter_loss", "drafter_train_s", "rollout_s", "loss", "lr")] == [
        "reward/reward_mean", "reward/eval_accuracy", "reward_fn/long", "rollout/response_len_p50",
        "rollout/accept_len_mean", "drafter/accept_len_est_frozen", "drafter/drafter_loss",
        "drafter/drafter_train_s", "time/rollout_s", "train/loss", "train/lr"]


MIXED_REWARD = '''
def mixed(response, answer):
    """Prompts answered "same" score 1 whatever the response: their groups have advantage 0;
    the others score the parity of the response's character codes, about half the samples."""
    return 1.0 if answer == "same" else float(sum(map(ord, response)) % 2)
'''


def _mixed_job(model_dir, tmp_path, *extra):
    from conftest import write_jsonl

    data = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": p, "answer": a}
                                                  for p, a in zip(["ab", "cd", "ef", "gh"], ["same", "x", "same", "x"])])
    reward = tmp_path / "mixed_reward.py"
    reward.write_text(MIXED_REWARD)
    return load_train_config(None, [f"run.model={model_dir}", f"data.train={data}", f"rl.reward={reward}:mixed",
                                    f"run.out_dir={tmp_path / 'runs'}", "rollout.group_size=8", "rl.lr=1e-2",
                                    "rollout.max_new_tokens=6", "run.eval_every=0", "rl.warmup=1", "spec.mode=off",
                                    *extra])


def _training_rows(s) -> list[int]:
    rows = []
    s.model.register_forward_hook(lambda m, args, _out: rows.append(args[0].shape[0]) if m.training else None)
    return rows


def test_skipping_zero_advantage_samples_leaves_the_gradient_as_it_was(model_dir, tmp_path):
    """Two of the four prompts score 1 whatever is sampled: their 16 samples have advantage 0,
    so with rl.skip_zero_advantage no forward computes them, and the step's gradient is the
    one computed over all 32, for every loss aggregation and both policy losses."""
    import torch

    from tailtamer.rl.run_state import setup
    from tailtamer.rl.trainer import rl_step

    for extra in (["rl.loss_agg=token-mean"], ["rl.loss_agg=seq-mean-token-mean"],
                  ["rl.loss_agg=seq-mean-token-sum-norm"], ["rl.policy_loss=gspo"]):
        grads, computed = [], []
        for skip in ("false", "true"):
            s = setup(_mixed_job(model_dir, tmp_path, "rollout.prompts_per_step=4", f"rl.skip_zero_advantage={skip}",
                                 *extra), log=lambda _: None)
            rows = _training_rows(s)
            rl_step(s)
            grads.append(torch.cat([p.grad.flatten() for p in s.model.parameters()]))
            computed.append(sum(rows))
            s.scorer.close()
        assert computed[0] == 32 and 0 < computed[1] <= 16, extra  # an "x" group may agree by chance too
        assert grads[0].abs().max() > 1e-4, extra
        assert torch.allclose(grads[1], grads[0], rtol=1e-5, atol=1e-8), extra


def test_a_step_whose_samples_all_have_advantage_0_still_steps_the_optimizer(model_dir, tmp_path):
    """One prompt per step: a "same" prompt's step computes nothing with skipping, yet AdamW
    takes its step (a zero gradient still moves the weights by the earlier steps' momentum),
    so four steps end with the weights they end with without skipping."""
    import torch

    from tailtamer.rl.run_state import setup
    from tailtamer.rl.trainer import rl_step

    weights, kinds = [], []
    for skip in ("false", "true"):
        s = setup(_mixed_job(model_dir, tmp_path, "rollout.prompts_per_step=1", f"rl.skip_zero_advantage={skip}"),
                  log=lambda _: None)
        rows = _training_rows(s)
        steps = []
        for _ in range(4):
            before = len(rows)
            rl_step(s)
            s.step += 1
            steps.append(len(rows) > before)
        kinds.append(steps)
        weights.append(torch.cat([p.detach().flatten() for p in s.model.parameters()]))
        s.scorer.close()
    assert kinds[0] == [True] * 4 and kinds[1].count(False) >= 2
    assert False in kinds[1][kinds[1].index(True):]  # a skipped step after a computed one
    assert torch.allclose(weights[1], weights[0], rtol=1e-5, atol=1e-7)


def test_a_policy_that_diverges_is_named_as_the_training_s_not_the_model_s(toy, tmp_path, monkeypatch):
    """Non-finite logits after updates were blamed on the model's config.json (rms_norm_eps,
    rope_theta), with no step, no rl.lr and no checkpoint named."""
    import torch

    from tailtamer.rl import trainer
    from tailtamer.rl.trainer import TrainingError

    update = trainer.update_policy

    def diverging(s, *args):  # the update of step 2 leaves the weights infinite
        out = update(s, *args)
        if s.step == 1:
            with torch.no_grad():
                s.model.norm.weight.fill_(float("inf"))
        return out

    monkeypatch.setattr(trainer, "update_policy", diverging)
    with pytest.raises(TrainingError, match=r"^step 3's rollout: the policy's logits are not finite \(NaN or inf\) "
                                            r"after 2 steps of updates: the training diverged \(rl.lr=.*\); lower "
                                            r"rl.lr and resume from a checkpoint before the divergence: the newest, "
                                            r"step 2, may hold the diverged weights; step-000001, the checkpoint "
                                            r"before it, can be resumed from: write its name into .*latest$"):
        train(load_train_config(None, toy + ["run.steps=4", "run.name=nan", "run.save_every=1"]), log=lambda _: None)
