"""Devices: the one module that asks PyTorch about accelerators (`torch.cuda` calls stay here)."""

from __future__ import annotations

import torch

from tailtamer.errors import ConfigError

SUPPORTED = ("cpu", "cuda")


def resolve_device(name: str | None, field: str = "--device") -> torch.device:
    """`cpu`, `cuda` or `cuda:N`; None picks cuda when this PyTorch build has a GPU, else cpu.
    A device this machine cannot run is a ConfigError naming `field`."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{field}: {name!r} is not a device; use one of {', '.join(SUPPORTED)} (or cuda:N)") from None
    if device.type not in SUPPORTED:
        raise ConfigError(f"{field}: device type {device.type!r} is not supported; use one of {', '.join(SUPPORTED)}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{field}: {name} was asked for, but this PyTorch build sees no CUDA GPU "
                              f"(torch {torch.__version__}); use cpu, or install a CUDA build of PyTorch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{field}: {name} does not exist; this machine has {torch.cuda.device_count()} GPU(s)")
    return device
