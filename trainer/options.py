"""Typed options: dataclass fields that carry their help, choices and resume rule, and become flags.

The trainer's config sections, a task's options and the doctor's settings are all dataclasses of
``option()`` fields. From them come the command-line flags (``add_flags``), the typed reading of
YAML values (``build``) and the rule a resume applies to a changed value (``ResumeRule``).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
from collections.abc import Iterable, Mapping
from typing import Any

from trainer.errors import ConfigError
from trainer.redact import redact
from trainer.registry import Registry

__all__ = ["ResumeRule", "check", "check_choice", "option"]

Choices = tuple[str, ...] | Registry[Any] | None


class ResumeRule(enum.Enum):
    """What resuming from a checkpoint does when this value differs from the checkpoint's."""

    ALLOW = "allow"  # takes the new value (more epochs, another log interval, another device)
    FLAG = "flag"  # refused unless named in --allow-resume-change (learning rate, batch size)
    REFUSE = "refuse"  # always refused: the checkpoint is of something else (task, model, dataset)
    IGNORE = "ignore"  # not compared: settings of the resume itself (--resume, --allow-resume-change)


def option(default: Any, help: str, choices: Choices = None, resume: ResumeRule = ResumeRule.ALLOW) -> Any:
    """A dataclass field with its CLI help, allowed values (a tuple or a registry) and resume rule."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "resume": resume})


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_choice(value: str, name: str, choices: Choices) -> None:
    """ConfigError naming the flag and the allowed values unless value is one of them."""
    if isinstance(choices, Registry):
        choices.check(value)
    elif choices is not None and value not in choices:
        raise ConfigError(f"{flag_of(name)} {value!r}: choose one of {', '.join(choices)}")


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def fields_of(kind: type) -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(kind)


def resume_rule(field: dataclasses.Field[Any]) -> ResumeRule:
    return field.metadata.get("resume", ResumeRule.ALLOW)


def add_flags(group: argparse._ActionsContainer, kind: type, defaults: Mapping[str, Any] | None = None) -> None:
    """One flag per field of ``kind``: ``--field-name``, typed, with the field's help and choices.

    Flags the user did not type are absent from the parsed namespace (SUPPRESS), so that values from a
    config file or the caller stay in force; the help shows the default that applies.
    """
    for field in fields_of(kind):
        default = (defaults or {}).get(field.name, field.default)
        choices = field.metadata.get("choices")
        # A default from the config file may be a URL with credentials: --help shows it redacted.
        help_text = f"{field.metadata.get('help', '')} (default: {redact(_shown(default))})"
        if isinstance(choices, Registry):
            help_text += f"; one of {choices.describe()}"
        common: dict[str, Any] = {"dest": field.name, "help": help_text.replace("%", "%%"),
                                  "default": argparse.SUPPRESS}
        if isinstance(field.default, bool):
            group.add_argument(flag_of(field.name), action=argparse.BooleanOptionalAction, **common)
        else:
            # A registry may resolve names it does not list: its check, not argparse's, decides.
            listed = choices if isinstance(choices, tuple) else None
            group.add_argument(flag_of(field.name), type=type(field.default), choices=listed,
                               metavar=field.name.upper(), **common)


def _shown(value: Any) -> str:
    return repr(value) if value == "" else str(value)


def build(kind: type, values: Mapping[str, Any], where: str = "") -> Any:
    """An instance of ``kind`` from config values, each coerced to its field's type; validation runs once."""
    known = {field.name: field for field in fields_of(kind)}
    typed = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in known:
            place = f" in {where}" if where else ""
            raise ConfigError(f"unknown config key {key!r}{place}; known keys: {', '.join(sorted(known))}")
        typed[name] = coerce(name, type(known[name].default), value)
    return kind(**typed)


def coerce(name: str, expected: type, value: Any) -> Any:
    """Accept YAML's natural types, refuse what would silently mean something else."""
    if expected is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {name!r} must be true or false, got {value!r}")
    if expected is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if expected is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if expected is str and isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"config key {name!r} must be {expected.__name__}, got {value!r}")


def as_dict(instance: Any) -> dict[str, Any]:
    return dataclasses.asdict(instance)


def names(kinds: Iterable[type]) -> set[str]:
    return {field.name for kind in kinds for field in fields_of(kind)}
