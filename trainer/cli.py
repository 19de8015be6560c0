"""Command line and config file: one flag per config field and per option of the task, YAML underneath.

Values are taken in this order, each over the one before: the defaults, the settings a script passes to
trainer.run (its own defaults), the YAML file (--config: this run's, a Kubernetes ConfigMap), then the
flags typed. The task is known first (from --task, the YAML file or the script), because its options
are flags too.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from trainer.config import DEFAULT_TASK, SECTIONS, Config
from trainer.errors import ConfigError, TaskError
from trainer.options import add_flags, build, fields_of, names
from trainer.redact import RedactingArgumentParser
from trainer.task import RunTask, TaskSpec, resolve
from trainer.tasks import TASKS

TASK_SECTION = "task"


def build_parser(spec: TaskSpec, prog: str = "ddp-train", task_fixed: bool = False,
                 underneath: tuple[Config, RunTask] | None = None) -> argparse.ArgumentParser:
    """``underneath``: the config before flags (defaults, file, settings), whose values --help shows."""
    parser = RedactingArgumentParser(
        prog=prog,
        description="Data-parallel training on CPU or GPU, under any launcher. Flags override values from --config.",
    )
    parser.add_argument("--config", default="", help="YAML file of config values (sections or flat keys)")
    if not task_fixed:
        parser.add_argument("--task", default=argparse.SUPPRESS,
                            help=f"what to train: a built-in task ({TASKS.describe()}) or a task class as "
                                 f"package.module:Class (default: {DEFAULT_TASK})")
    for section, kind in SECTIONS.items():
        add_flags(parser.add_argument_group(section), kind, _values(underneath, section))
    add_flags(parser.add_argument_group(f"task {spec.describe()}"), spec.options_type,
              _values(underneath, TASK_SECTION))
    return parser


def _values(underneath: tuple[Config, RunTask] | None, section: str) -> dict[str, Any] | None:
    if underneath is None:
        return None
    return {key: value for key, value in layout(*underneath)[section].items() if key != "name"}


def parse_config(argv: Sequence[str] | None = None, task: str | type | None = None,
                 settings: Mapping[str, Any] | None = None, prog: str = "ddp-train") -> tuple[Config, RunTask]:
    """The validated config and the task it trains, with its options; ``task`` fixes the task (a script's own)."""
    known, _ = _pre_parser(task is not None, prog).parse_known_args(argv)
    file_values = load_yaml(known.config) if known.config else {}
    values = _merged(dict(settings or {}), file_values)
    spec = resolve(_task_source(task, getattr(known, "task", None), values), TASKS)
    _check_option_names(spec)
    underneath = config_from_values(spec, values)
    given = vars(build_parser(spec, prog, task_fixed=task is not None, underneath=underneath).parse_args(argv))
    # The full parser takes a shortened --config or --task (--conf) as the flag; the pre-parser, which reads them,
    # does not: such a file or task would be silently left out.
    for flag in ("config", "task"):
        if flag in given and given.pop(flag) != getattr(known, flag, given.get(flag)):
            raise ConfigError(f"a shortened --{flag} flag is not read: write --{flag} in full")
    return config_from_values(spec, values, given)


def config_from_values(spec: TaskSpec, values: Mapping[str, Any], flags: Mapping[str, Any] | None = None
                       ) -> tuple[Config, RunTask]:
    """A Config and the task with its options, from nested ``{section: {field: value}}`` and/or flat
    ``{field: value}`` values, then flags."""
    task_fields = {field.name for field in fields_of(spec.options_type)}
    owner = {field.name: section for section, kind in SECTIONS.items() for field in fields_of(kind)}
    owner.update(dict.fromkeys(task_fields, TASK_SECTION))
    nested: dict[str, dict[str, Any]] = {name: {} for name in [*SECTIONS, TASK_SECTION]}
    for key, value in values.items():
        if key == TASK_SECTION:
            if isinstance(value, Mapping):
                for inner, inner_value in value.items():
                    if inner != "name":
                        _place(nested, owner, inner, inner_value, TASK_SECTION, spec)
            continue
        if key in SECTIONS and isinstance(value, Mapping):
            for inner, inner_value in value.items():
                _place(nested, owner, inner, inner_value, key, spec)
        else:
            _place(nested, owner, key, value, None, spec)
    for key, value in (flags or {}).items():
        nested[owner[key]][key] = value
    sections = {name: build(kind, nested[name], where=f"section {name!r}") for name, kind in SECTIONS.items()}
    options = build(spec.options_type, nested[TASK_SECTION], where=f"the options of task {spec.describe()}")
    return Config(**sections), RunTask(spec, options)


def _pre_parser(task_fixed: bool, prog: str) -> argparse.ArgumentParser:
    """--config and --task alone, read before the full parser exists (the task's options are flags too)."""
    parser = RedactingArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    parser.add_argument("--config", default="")
    if not task_fixed:
        parser.add_argument("--task", default=None)
    return parser


def _task_source(fixed: str | type | None, flag: str | None, values: Mapping[str, Any]) -> str | type:
    named = values.get(TASK_SECTION)
    in_file = named.get("name") if isinstance(named, Mapping) else named
    if fixed is not None:
        if in_file is not None and not _same_task(in_file, fixed):
            raise ConfigError(f"the config names task {in_file!r}, but this script trains its own task; remove "
                              f"the name from the config's 'task' section")
        return fixed
    return flag or in_file or DEFAULT_TASK


def _same_task(named: str, fixed: str | type) -> bool:
    """Whether a config's task name means the script's task (its name, or an import path to it)."""
    fixed_cls = resolve(fixed, TASKS).cls
    if named == fixed_cls.name:
        return True
    try:
        return resolve(named, TASKS).cls is fixed_cls
    except TaskError:
        return False


def _check_option_names(spec: TaskSpec) -> None:
    taken = names(SECTIONS.values()) | {"config", "task", "name"}
    clashes = sorted({field.name for field in fields_of(spec.options_type)} & taken)
    if clashes:
        raise TaskError(f"task {spec.describe()}: option {', '.join(clashes)} has the name of one of the trainer's "
                        f"own settings; rename it")


def _place(nested: dict[str, dict[str, Any]], owner: Mapping[str, str], key: str, value: Any,
           expected: str | None, spec: TaskSpec) -> None:
    name = key.replace("-", "_")
    section = owner.get(name)
    if section is None or (expected is not None and section != expected):
        if section is not None:
            where = "under 'task:'" if section == TASK_SECTION else f"under '{section}:'"
            raise ConfigError(f"config key {key!r} is in section {expected!r} but belongs {where} (or write it as "
                              f"a top-level key)")
        raise ConfigError(f"unknown config key {key!r}; known keys: {', '.join(sorted(owner))} (task "
                          f"{spec.describe()})")
    nested[section][name] = value


def _merged(below: Mapping[str, Any], above: Mapping[str, Any]) -> dict[str, Any]:
    """``above`` over ``below``; both may mix sections and flat keys."""
    merged = dict(below)
    for key, value in above.items():
        if key in merged and isinstance(merged[key], Mapping) and isinstance(value, Mapping):
            merged[key] = {**merged[key], **value}
        elif key == TASK_SECTION and isinstance(merged.get(key), Mapping) and isinstance(value, str):
            merged[key] = {**merged[key], "name": value}
        else:
            merged[key] = value
    return merged


def load_yaml(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        loaded = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"--config {path}: not valid YAML ({error})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config {path}: expected a mapping of config keys, got {type(loaded).__name__}")
    return loaded


def layout(config: Config, task: RunTask) -> dict[str, Any]:
    """The YAML layout: ``task: {name: ..., <options>}`` then one mapping per section."""
    return {TASK_SECTION: task.to_dict(), **config.to_dict()}


def dump_yaml(config: Config, task: RunTask) -> str:
    return yaml.safe_dump(layout(config, task), sort_keys=False)
