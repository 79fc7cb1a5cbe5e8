"""The one check every reader of a model directory starts with."""

from __future__ import annotations

from pathlib import Path

from tailtamer.errors import CheckpointError


def check_model_dir(model_dir: Path) -> None:
    if model_dir.is_file():
        raise CheckpointError(f"{model_dir} is a file; a model is a directory (config.json, model.safetensors, "
                              f"tokenizer.json)")
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: model directory not found")
