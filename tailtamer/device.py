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
    if device.type == "cpu" and device.index not in (None, 0):  # PyTorch takes any index and runs on the one CPU
        raise ConfigError(f"{field}: {name!r}: the CPU is one device, cpu (or cpu:0); use cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{field}: {name} was asked for, but this PyTorch build sees no CUDA GPU "
                              f"(torch {torch.__version__}); use cpu, or install a CUDA build of PyTorch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{field}: {name} does not exist; this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def train_device(name: str | None, local_rank: int) -> torch.device:
    """The device a training worker runs on: `run.device` resolved, and on CUDA without an
    index the worker's own GPU (cuda:LOCAL_RANK), made current so NCCL collectives use it."""
    device = resolve_device(name, "run.device")
    if device.type == "cuda":
        if device.index is None:
            if local_rank >= torch.cuda.device_count():
                raise ConfigError(f"run.device: worker {local_rank} on this machine has no GPU of its own "
                                  f"({torch.cuda.device_count()} GPU(s)); start at most that many workers per machine")
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def collective_backend(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


# run.dtype's choices; auto resolves per device (train_dtype)
TRAIN_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def train_dtype(name: str, device: torch.device) -> torch.dtype:
    """The precision of the training forwards for `run.dtype`: auto is bfloat16 where the
    device computes it natively (a CUDA GPU that supports it), float32 elsewhere (this CPU
    has no fast bfloat16 matmul: it would only be slower)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    dtype = TRAIN_DTYPES[name]
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"run.dtype: {device} does not support bfloat16; use run.dtype=float32")
    return dtype


def device_memory(device: torch.device) -> int | None:
    """Bytes free on a CUDA device now; None on CPU (tailtamer.memory reads the machine's)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for a forward in `dtype` (weights stay as they are); float32: a no-op."""
    import contextlib

    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def device_name(device: torch.device) -> str | None:
    """The GPU's product name (for reports); None on CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def gpu_count() -> int:
    """CUDA GPUs this process sees (0 without a CUDA build): one worker each by default."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
