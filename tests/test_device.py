"""Device, precision and memory settings of the trainer, on this CPU: gradient checkpointing
changes nothing but memory, bfloat16 training keeps float32 weights and log-probs, and a device
the machine lacks is a start-up error that writes nothing."""

from pathlib import Path

import pytest
import torch

from tailtamer.config import load_train_config
from tailtamer.errors import ConfigError
from tailtamer.rl.run_state import prepare, setup
from tailtamer.rl.trainer import train
from test_trainer import TIME_FIELDS, _rows


def _run(overrides, name):
    cfg = load_train_config(None, overrides + [f"run.name={name}", "run.save_every=0", "run.workers=1"])
    train(cfg, log=lambda _: None, console=lambda _: None)
    return _rows(Path(cfg.run.out_dir) / name)


def test_gradient_checkpointing_gives_the_same_run(toy):
    plain = _run(toy + ["run.steps=2", "rl.lr=3e-3"], "plain")
    recomputed = _run(toy + ["run.steps=2", "rl.lr=3e-3", "rl.grad_checkpointing=true"], "recomputed")
    drop = lambda rows: [{k: v for k, v in r.items() if k not in TIME_FIELDS} for r in rows]  # noqa: E731
    assert drop(plain) == drop(recomputed)  # same losses, same weights checksum


def test_checkpointed_layers_are_recomputed_in_backward(toy):
    s = setup(prepare(load_train_config(None, toy + ["rl.grad_checkpointing=true"])))
    calls, layer = [], s.model.layers[0]
    forward = layer.forward
    layer.forward = lambda *a: calls.append(1) or forward(*a)
    ids = torch.tensor([[1, 2, 3, 4]])
    s.model(ids)[0].sum().backward()
    assert len(calls) == 2  # once in the forward, once more in backward
    s.model.grad_checkpointing = False
    calls.clear()
    s.model(ids)[0].sum().backward()
    assert len(calls) == 1


def test_bfloat16_training_keeps_float32_weights_and_log_probs(toy, monkeypatch):
    from tailtamer.rl import grpo

    seen = []
    real = grpo.token_log_probs
    monkeypatch.setattr(grpo, "token_log_probs", lambda logits, *a: seen.append(logits.dtype) or real(logits, *a))
    rows = _run(toy + ["run.steps=2", "rl.lr=3e-3", "run.dtype=bfloat16"], "bf16")
    assert torch.bfloat16 in seen  # the forwards ran in bfloat16 ...
    assert all(r["loss"] is not None and abs(r["loss"]) < 1e3 for r in rows)
    assert rows[0]["weights_sha"] != rows[1]["weights_sha"]  # ... and the update moved the weights
    s = setup(prepare(load_train_config(None, toy + ["run.dtype=bfloat16"])))
    assert s.dtype == torch.bfloat16 and s.model.dtype == torch.float32  # master weights
    logits = torch.randn(2, 3, 11, dtype=torch.bfloat16)
    assert real(logits, torch.zeros(2, 3, dtype=torch.long)).dtype == torch.float32


def test_auto_precision_is_float32_on_cpu(toy):
    assert setup(prepare(load_train_config(None, toy))).dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_missing_gpu_is_a_startup_error_that_writes_nothing(toy, tmp_path):
    with pytest.raises(ConfigError, match=r"run.device: cuda was asked for, but this PyTorch build sees no CUDA GPU"):
        train(load_train_config(None, toy + ["run.device=cuda", "run.name=gpu"]), log=lambda _: None)
    assert not (tmp_path / "runs" / "gpu").exists()
    with pytest.raises(ConfigError, match="run.dtype must be one of auto, float32, bfloat16"):
        load_train_config(None, toy + ["run.dtype=float16"])


def test_a_run_that_cannot_fit_is_refused_before_loading_and_writes_nothing(toy, tmp_path, monkeypatch):
    import tailtamer.rl.run_state as run_state

    lines = []
    train(load_train_config(None, toy + ["run.steps=1", "run.name=fits"]), log=lines.append, console=lambda _: None)
    estimate = next(line for line in lines if line.startswith("memory per worker:"))
    assert "KV cache" in estimate and "optimizer" in estimate
    monkeypatch.setattr(run_state, "available_memory", lambda *a, **k: 1 << 20)  # 1 MiB free
    monkeypatch.setattr(run_state, "load_model", lambda *a, **k: pytest.fail("loaded a model that cannot fit"))
    with pytest.raises(ConfigError) as e:
        train(load_train_config(None, toy + ["run.name=huge"]), log=lambda _: None)
    # one line naming the largest piece (here the update's activations) and what shrinks it
    assert "\n" not in str(e.value) and "activations" in str(e.value) and "rl.grad_checkpointing=true" in str(e.value)
    assert not (tmp_path / "runs" / "huge").exists()
