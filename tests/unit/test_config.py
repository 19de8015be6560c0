"""Configuration: flags over YAML over defaults, validated once, with messages that name the flag."""

from __future__ import annotations

import pytest

from trainer.cli import build_parser, parse_config
from trainer.config import Config
from trainer.errors import ConfigError


def test_every_config_field_has_a_flag_with_help():
    parser = build_parser()
    flags = {option for action in parser._actions for option in action.option_strings}
    for section in Config().to_dict().values():
        for name in section:
            assert "--" + name.replace("_", "-") in flags
    assert all(action.help for action in parser._actions)


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("optim:\n  lr: 0.01\n  optimizer: sgd\nepochs: 5\nbatch-size: 32\n")
    config = parse_config(["--config", str(file), "--lr", "0.2", "--sync-bn"])
    assert config.optim.lr == 0.2 and config.optim.optimizer == "sgd"
    assert config.train.epochs == 5 and config.train.batch_size == 32 and config.model.sync_bn


def test_config_round_trips_through_a_dict():
    config = parse_config(["--model", "lenet", "--keep-last", "4"])
    assert Config.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(("argv", "message"), [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--keep-last", "1"], "--keep-last must be >= 2"),
    (["--synthetic-shape", "3,32"], "--synthetic-shape '3,32'"),
    (["--device", "cpu", "--precision", "fp16"], "fp16 needs a GPU"),
])
def test_invalid_values_name_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv)


def test_yaml_errors_name_the_key(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("lr: fast\n")
    with pytest.raises(ConfigError, match="'lr' must be float"):
        parse_config(["--config", str(file)])
    file.write_text("learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="unknown config key 'learning_rate'"):
        parse_config(["--config", str(file)])
    with pytest.raises(ConfigError, match="no such file"):
        parse_config(["--config", str(tmp_path / "missing.yaml")])
