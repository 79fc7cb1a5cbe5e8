"""The one check every reader of a model directory starts with."""

from __future__ import annotations

from pathlib import Path

from tailtamer.errors import CheckpointError


def check_model_dir(model_dir: Path) -> None:
    """A directory, and not a training run's or its `latest` pointer: those name the
    checkpoint to give instead (each checkpoint is a model directory)."""
    if model_dir.is_file():
        if model_dir.name == "latest" and model_dir.parent.name == "checkpoints":
            name = model_dir.read_text(errors="replace").strip()
            raise CheckpointError(f"{model_dir} is the run's pointer to its newest checkpoint; give that checkpoint: "
                                  f"{model_dir.parent / name}")
        raise CheckpointError(f"{model_dir} is a file; a model is a directory (config.json, model.safetensors, "
                              f"tokenizer.json)")
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: model directory not found")
    if (model_dir / "checkpoints").is_dir() and not (model_dir / "config.json").is_file():
        raise CheckpointError(f"{model_dir} is a training run, not a model; give one of its checkpoints: "
                              f"{model_dir / 'checkpoints'}/step-N")
