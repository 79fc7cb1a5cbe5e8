"""Run checkpoints: policy (HF model dir), optimizer, scheduler and trainer state.

A checkpoint is written into a temporary directory and renamed into place, then the
`latest` pointer is replaced atomically: a run killed at any moment (SIGKILL included) leaves
the previous checkpoint valid and `latest` pointing at a complete one.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from tailtamer.atomic import atomic_write_json, atomic_write_text, write_dir
from tailtamer.errors import CheckpointError
from tailtamer.model.io import load_model, save_model
from tailtamer.rl.run_dir import has_checkpoint, unstarted_run


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer_state: dict, scheduler, state: dict,
                    keep: int = 2, extra=None) -> Path:
    """`optimizer_state` as an unsharded optimizer's `state_dict()` gives it (run.shard=fsdp
    gathers it so); `extra(tmp_dir)` writes more parts (e.g. the drafter) into the checkpoint
    before it is renamed into place."""
    root = run_dir / "checkpoints"
    final = root / f"step-{step:06d}"

    def write(tmp: Path) -> None:
        save_model(model, tmp)
        tokenizer.save(tmp)
        torch.save({"optimizer": optimizer_state, "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
        if extra is not None:
            extra(tmp)
        atomic_write_json(tmp / "state.json", {**state, "step": step})

    write_dir(final, write, existing="replace")
    atomic_write_text(root / "latest", final.name + "\n")
    kept = {p.name: _eval_accuracy(p) for p in root.glob("step-*") if p.is_dir()}
    for name in checkpoints_to_delete(kept, keep, final.name):
        shutil.rmtree(root / name, ignore_errors=True)
    return final


def _eval_accuracy(checkpoint: Path) -> float | None:
    try:
        return json.loads((checkpoint / "state.json").read_text()).get("eval_accuracy")
    except (OSError, ValueError):
        return None


def checkpoints_to_delete(accuracy: dict[str, float | None], keep: int, current: str) -> list[str]:
    """Checkpoint names to remove: all but the newest `keep` up to `current` (the one just
    written, which `latest` names; by step number), and the best by held-out accuracy among
    those that were evaluated (the earliest of equals), which stays whatever its age
    (run.keep_checkpoints). Checkpoints newer than `current` are left over from a run resumed
    from an earlier one, and go."""
    step = lambda name: int(name.rsplit("-", 1)[1])  # noqa: E731
    names = sorted(accuracy, key=step)
    now = [n for n in names if step(n) <= step(current)]
    scored = [n for n in now if accuracy[n] is not None]
    best = max(scored, key=lambda n: (accuracy[n], -step(n))) if scored else None
    keep_names = set(now[-keep:]) | {best, current}
    return [n for n in names if n not in keep_names]


def latest_checkpoint(run_dir: Path) -> Path:
    pointer = run_dir / "checkpoints" / "latest"
    if not has_checkpoint(run_dir):
        anew = f"; it stopped in its first step: start it anew with `tailtamer train {run_dir / 'config.yaml'}`, " \
            "which reuses the directory" if unstarted_run(run_dir) else resumable_hint(pointer.parent)
        raise CheckpointError(f"{run_dir}: no checkpoint to resume from (checkpoints/latest is missing){anew}")
    name = pointer.read_bytes().decode("utf-8", errors="replace").strip()
    if not re.fullmatch(r"step-\d{6,}", name):
        raise CheckpointError(f"{pointer}: expected the name of a checkpoint of this run (step-NNNNNN), got "
                              f"{name[:40]!r}{resumable_hint(pointer.parent)}")
    path = run_dir / "checkpoints" / name
    if not (path / "state.json").is_file():
        raise CheckpointError(f"{path}: checkpoint is incomplete (no state.json){earlier_checkpoint_hint(path)}")
    return path


def resumable_hint(checkpoints: Path, before: str | None = None) -> str:
    """For a message about a damaged or missing checkpoint: how to resume from the newest
    complete one kept (below `before`, a checkpoint's name), or nothing when none is."""
    kept = sorted(p.name for p in checkpoints.glob("step-*") if (p / "state.json").is_file()
                  and re.fullmatch(r"step-\d{6,}", p.name) and (before is None or p.name < before))
    which = "the checkpoint before it" if before else "a complete checkpoint"
    return f"; {kept[-1]}, {which}, can be resumed from: write its name into {checkpoints / 'latest'}" if kept else ""


def earlier_checkpoint_hint(path: Path) -> str:
    """`resumable_hint` for the checkpoint at `path` that cannot be read."""
    return resumable_hint(path.parent, path.name)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint (`latest_checkpoint`'s, named step-NNNNNN) was written after."""
    return int(path.name.removeprefix("step-"))


def load_checkpoint(path: Path, optimizer_factory, dtype="float32", device="cpu", load_optimizer_state=None):
    """(model, optimizer, scheduler, state) from a checkpoint directory, the model on `device`;
    `load_optimizer_state(optimizer, state_dict)` restores the optimizer (default: its own
    load_state_dict; a sharded optimizer scatters the whole state)."""
    model = load_model(path, dtype, device)
    optimizer, scheduler = optimizer_factory(model)
    # The run's config may have changed its optimizer settings (recorded in resumes.jsonl):
    # the saved state brings back moments and the step, the config the hyperparameters, and
    # the optimizer as built here its kernel (a fused run's state may resume FSDP2 shards).
    settings = [{k: g[k] for k in ("betas", "eps", "weight_decay", "initial_lr", "fused", "foreach") if k in g}
                for g in optimizer.param_groups]
    base_lrs = list(scheduler.base_lrs)
    try:
        blob = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        (load_optimizer_state or type(optimizer).load_state_dict)(optimizer, blob["optimizer"])
        scheduler.load_state_dict(blob["scheduler"])
        scheduler.base_lrs = base_lrs
        for group, given, factor in zip(optimizer.param_groups, settings, scheduler.lr_lambdas):
            group.update(given)
            group["lr"] = group["initial_lr"] * factor(scheduler.last_epoch)
    except Exception as e:  # torch.load raises many types for a torn or foreign file
        raise CheckpointError(f"{path / 'optimizer.pt'}: cannot restore the optimizer "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    try:
        state = json.loads((path / "state.json").read_text())
        if not isinstance(state["step"], int) or isinstance(state["step"], bool) or state["step"] < 0:
            raise ValueError(f"step must be an integer >= 0, got {state['step']!r}")
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path / 'state.json'}: cannot read the trainer state ({type(e).__name__}: {e})") from None
    return model, optimizer, scheduler, state
