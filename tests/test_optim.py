"""Learning-rate schedules and AdamW settings of the policy update (rl/optim.py)."""

import math

import pytest
import torch

from tailtamer.rl.optim import lr_factor


def test_schedules_by_hand():
    # warm-up 2 of 10 optimizer steps: 1/2, 2/2, then the schedule over the remaining 8
    assert [lr_factor("constant", k, 2, 10) for k in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor("linear", 2, 2, 10) == 1.0 and lr_factor("linear", 6, 2, 10) == pytest.approx(0.5)
    assert lr_factor("linear", 10, 2, 10) == 0.0 and lr_factor("linear", 10, 2, 10, min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor("cosine", 6, 2, 10) == pytest.approx(0.5)  # halfway: (1 + cos π/2)/2
    assert lr_factor("cosine", 4, 2, 10, 0.2) == pytest.approx(0.2 + 0.8 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_factor("cosine", 50, 2, 10, 0.2) == pytest.approx(0.2)  # past the end: the floor
    assert lr_factor("constant", 0, 0, 10) == 1.0  # no warm-up


def test_a_run_follows_the_schedule_and_the_adamw_settings(toy, tmp_path):
    from test_rl_options import _run
    from tailtamer.config import load_train_config
    from tailtamer.rl.run_state import prepare, setup

    rows = _run(toy + ["run.steps=4", "rl.minibatches=1", "rl.warmup=1", "rl.lr=1e-3", "rl.lr_schedule=cosine",
                       "rl.min_lr_ratio=0.1"], "cosine")
    # the lr logged after step s's optimizer step, which was step s - 1 (0-based) of 4
    expected = [1e-3 * lr_factor("cosine", s, 1, 4, 0.1) for s in range(1, 5)]
    assert [r["lr"] for r in rows] == pytest.approx(expected)
    s = setup(prepare(load_train_config(None, toy + ["rl.adam_beta2=0.95", "rl.adam_eps=1e-6"])))
    group = s.optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-6
    assert group["fused"]  # torch's fused kernel on plain CPU tensors (FSDP2's shards: test_dist)


@pytest.mark.parametrize("override, field", [("rl.lr_schedule=exp", "rl.lr_schedule"), ("rl.adam_beta2=1", "rl.adam_beta2"),
                                             ("rl.min_lr_ratio=2", "rl.min_lr_ratio"), ("rl.adam_eps=0", "rl.adam_eps")])
def test_bad_optimizer_settings_name_the_field(override, field):
    from tailtamer.config import load_train_config
    from tailtamer.errors import ConfigError

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_train_config(None, [override])


def test_checkpoints_kept_are_the_newest_and_the_best_evaluated():
    from tailtamer.rl.checkpoint import checkpoints_to_delete

    acc = {"step-000010": 0.5, "step-000020": 0.7, "step-000030": None, "step-000040": 0.6, "step-000050": None}
    assert checkpoints_to_delete(acc, 2, "step-000050") == ["step-000010", "step-000030"]  # 20 is the best: kept
    assert checkpoints_to_delete(acc, 1, "step-000050") == ["step-000010", "step-000030", "step-000040"]
    assert checkpoints_to_delete({"step-000010": None, "step-000020": None}, 1, "step-000020") == ["step-000010"]
    ties = {"step-000010": 0.7, "step-000020": 0.7, "step-000030": 0.1}
    assert checkpoints_to_delete(ties, 1, "step-000030") == ["step-000020"]
    # resumed from step 20 with newer leftovers: the one just written is never deleted, the leftovers go
    assert checkpoints_to_delete({"step-000010": None, "step-000020": None, "step-000030": None,
                                  "step-000040": None}, 2, "step-000020") == ["step-000030", "step-000040"]
    # by step number, not by name: step 1000000 is newer than 999999
    assert checkpoints_to_delete({"step-999999": None, "step-1000000": None}, 1, "step-1000000") == ["step-999999"]


def test_a_run_keeps_the_best_checkpoint_by_held_out_accuracy(toy, tmp_path):
    import json

    from conftest import write_jsonl
    from tailtamer.config import load_train_config
    from tailtamer.rl.trainer import train

    held_out = write_jsonl(tmp_path / "held_out.jsonl", [{"prompt": p, "answer": "0"} for p in "abcdefghijklmnop"])
    train(load_train_config(None, toy + [f"data.eval={held_out}", "run.steps=4", "run.save_every=1", "run.eval_every=1",
                                         "rl.lr=3e-2", "run.keep_checkpoints=1", "run.name=keep"]),
          log=lambda _: None, console=lambda _: None)
    root = tmp_path / "runs" / "keep" / "checkpoints"
    rows = [json.loads(x) for x in (tmp_path / "runs" / "keep" / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval_accuracy"] for r in rows]
    best = accuracy.index(max(accuracy)) + 1  # the checkpoint of the k-th step is step-k
    expected = sorted({f"step-{4:06d}", f"step-{best:06d}"})
    assert sorted(p.name for p in root.glob("step-*")) == expected
    assert json.loads((root / f"step-{best:06d}" / "state.json").read_text())["eval_accuracy"] == max(accuracy)


def test_a_resume_takes_changed_optimizer_settings_from_the_config(toy, tmp_path):
    from tailtamer.config import load_train_config
    from tailtamer.rl.run_state import prepare, setup
    from tailtamer.rl.trainer import train

    train(load_train_config(None, toy + ["run.steps=2", "run.save_every=2", "rl.lr=1e-3", "rl.warmup=0",
                                         "run.name=r"]), log=lambda _: None, console=lambda _: None)
    run = tmp_path / "runs" / "r"
    cfg = load_train_config(run / "config.yaml", ["run.steps=4", "rl.lr=5e-4", "rl.adam_beta2=0.95"])
    s = setup(prepare(cfg), resume=run, log=lambda _: None)
    group = s.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(5e-4) and group["betas"] == (0.9, 0.95)
    assert s.optimizer.state  # the moments came back with the checkpoint


def test_a_resume_keeps_the_kernel_the_optimizer_was_built_with(toy, tmp_path):
    """A checkpoint of a fused AdamW (plain tensors) restores into a non-fused one (FSDP2's
    DTensor shards run torch's default kernel): the saved state must not switch it back."""
    from tailtamer.config import load_train_config
    from tailtamer.rl.checkpoint import load_checkpoint
    from tailtamer.rl.trainer import train

    train(load_train_config(None, toy + ["run.steps=1", "run.save_every=1", "run.name=r"]),
          log=lambda _: None, console=lambda _: None)
    step = tmp_path / "runs" / "r" / "checkpoints" / "step-000001"
    assert torch.load(step / "optimizer.pt", weights_only=True)["optimizer"]["param_groups"][0]["fused"]
    _, optimizer, _, _ = load_checkpoint(step, unfused_adamw)
    assert not optimizer.param_groups[0]["fused"] and optimizer.state


def unfused_adamw(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=False)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0)
