"""Helpers shared by every config dataclass: fields with help text, bound checks, and the
files a config names made absolute paths."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field

from tailtamer.errors import ConfigError


def at_least(section, name: str, minimum: int, *fields_: str) -> None:
    for fl in fields_:
        if getattr(section, fl) < minimum:
            raise ConfigError(f"{name}.{fl} must be >= {minimum}, got {getattr(section, fl)}")


def at_most(section, name: str, maximum: float, *fields_: str) -> None:
    for fl in fields_:
        if getattr(section, fl) > maximum:
            raise ConfigError(f"{name}.{fl} must be <= {maximum}, got {getattr(section, fl)}")


def positive(section, name: str, *fields_: str) -> None:
    for fl in fields_:
        if not getattr(section, fl) > 0:
            raise ConfigError(f"{name}.{fl} must be > 0, got {getattr(section, fl)}")


def f(default, help: str):
    """A field with its help text (shown by `tailtamer train --help-config`)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def same_as(cls, name: str):
    """The field `name` of dataclass `cls` (its default and help) for another section that
    sets the same thing: declared once."""
    source = next(fl for fl in dataclasses.fields(cls) if fl.name == name)
    return f(source.default, source.metadata["help"])


def _absolute(path, keep: tuple[str, ...] = ()):
    if not isinstance(path, str) or not path or path in keep:  # "" is no path: its own check says so
        return path
    return os.path.abspath(os.path.expanduser(path))


def _absolute_reward(spec):
    target, sep, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", spec)
    return f"{_absolute(target)}:{name}" if sep and target.endswith(".py") else spec


# The fields naming files a run reads, and the values of each that are names, not paths.
PATH_FIELDS = {("run", "model"): (), ("data", "train"): ("builtin",), ("data", "eval"): ("builtin",),
               ("spec", "drafter"): ("builtin", "ngram", "suffix")}


def absolute_paths(data: dict) -> dict:
    """A config dict (`to_dict`, or a run's config.yaml as read) with the files it names as
    absolute paths, relative ones taken from the working directory: a run's config.yaml then
    resumes from any directory, and one an older tailtamer wrote compares equal from its own."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for (section, key), keep in PATH_FIELDS.items():
        if isinstance(out.get(section), dict) and key in out[section]:
            out[section][key] = _absolute(out[section][key], keep)
    rl = out.get("rl")
    if isinstance(rl, dict) and "reward" in rl:
        rewards = rl["reward"]
        rl["reward"] = [_absolute_reward(r) for r in rewards] if isinstance(rewards, list) else _absolute_reward(rewards)
    return out
