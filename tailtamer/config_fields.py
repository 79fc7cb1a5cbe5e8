"""Helpers shared by every config dataclass: fields with help text and bound checks."""

from __future__ import annotations

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
