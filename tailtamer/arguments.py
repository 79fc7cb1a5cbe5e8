"""Checks of command-line values shared by the commands: each refuses a value in one line
naming its flag."""

from __future__ import annotations

import argparse
import re

from tailtamer.errors import TailtamerError


def nonempty(text: str) -> str:
    """argparse type of a path or name: `--model=` (an empty value) is refused, where it would
    otherwise read as the current directory or be dropped for the default."""
    if not text:
        raise argparse.ArgumentTypeError("empty; give a value")
    return text


def seed(text: str) -> int:
    """argparse type: a seed PyTorch accepts."""
    value = int(text) if re.fullmatch(r"[0-9]+", text) else -1  # int() takes '1_000', ' 5', other scripts' digits
    if not 0 <= value < 2 ** 63:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer from 0 to 2**63-1")
    return value


def preset(text: str) -> str:
    """argparse type of --preset: a model preset's name (model/config.py's PRESETS)."""
    from tailtamer.model.config import PRESETS

    if nonempty(text) not in PRESETS:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown; choose one of {', '.join(sorted(PRESETS))}")
    return text


def check_responses_fit(prompts: int, n: int, max_new_tokens: int, advice: str, available: int | None = None) -> None:
    """`generate` and `demo` keep every response until they write them: refused before they
    start when the responses could not fit in this machine's memory (a mistyped --n would
    otherwise grow until the machine runs out)."""
    from tailtamer.memory import available_memory, responses_bytes, size

    available = available_memory("cpu") if available is None else available
    need = responses_bytes(prompts * n, max_new_tokens)
    if available is not None and need > available:
        raise TailtamerError(f"{prompts} prompt{'s' * (prompts != 1)} x {n} samples of up to {max_new_tokens} tokens "
                             f"may need {size(need)} of memory, more than the {size(available)} available; {advice}")


def at_least_one(value: int, flag: str) -> int:
    if value < 1:
        raise TailtamerError(f"{flag} must be >= 1, got {value}")
    return value
