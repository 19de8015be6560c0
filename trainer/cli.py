"""Command line: one flag per config field, with the field's help; an optional YAML file underneath."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from trainer.config import SECTIONS, Config
from trainer.errors import ConfigError


def build_parser(prog: str = "ddp-train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Data-parallel training on CPU or GPU, under any launcher. "
        "Flags override values from --config.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", default="", help="YAML file of config values (sections or flat keys)")
    for section, kind in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(kind):
            flag = "--" + f.name.replace("_", "-")
            # SUPPRESS: only flags the user typed override the YAML file and the defaults.
            common: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"], "default": argparse.SUPPRESS}
            if isinstance(f.default, bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
            else:
                group.add_argument(flag, type=type(f.default), choices=f.metadata.get("choices"), **common)
    return parser


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """Defaults, then the YAML file, then the flags; validated once, as a whole."""
    args = vars(build_parser().parse_args(argv))
    config_path = args.pop("config", "")
    values: dict[str, Any] = load_yaml(config_path) if config_path else {}
    flat = _flatten(values)
    flat.update(args)
    return Config.from_dict(flat)


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


def _flatten(values: dict[str, Any]) -> dict[str, Any]:
    """Sections to flat keys, keeping a section's name check in Config.from_dict."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, dict):
            flat[key] = value
        else:
            flat[key.replace("-", "_")] = value
    return flat


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
