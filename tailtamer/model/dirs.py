"""The one check every reader of a model directory starts with."""

from __future__ import annotations

import json
from pathlib import Path

from tailtamer.errors import CheckpointError, ConfigError


def check_model_dir(model_dir: Path) -> None:
    """A directory, and not a training run's, its checkpoints directory or `latest` pointer:
    those name the checkpoint to give instead (each checkpoint is a model directory); nor an
    EAGLE drafter's."""
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
    if model_dir.name == "checkpoints" and (model_dir / "latest").is_file():
        raise CheckpointError(f"{model_dir} holds a run's checkpoints; give one of them: {model_dir}/step-N (the "
                              f"newest: {model_dir / (model_dir / 'latest').read_text(errors='replace').strip()})")
    if not (model_dir / "tokenizer.json").is_file() and _is_drafter(model_dir / "config.json"):
        raise CheckpointError(f"{model_dir} is an EAGLE drafter, not a model: give it as the drafter (--drafter, "
                              f"spec.drafter) and its target model as the model")


def check_run_model(model_dir: str | Path) -> None:
    """`check_model_dir` of run.model, its failure a ConfigError naming the field."""
    try:
        check_model_dir(Path(model_dir))
    except CheckpointError as e:
        raise ConfigError(f"run.model {e}") from None


def _is_drafter(config: Path) -> bool:
    try:
        architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):  # not there or not a config: the loader says which
        return False
    return any(isinstance(a, str) and a.endswith("Eagle") for a in architectures)
