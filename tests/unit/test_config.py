"""Configuration: flags over a script's settings over YAML over defaults, validated once, with messages
that name the flag; the task's options are flags too; every list of names comes from a registry."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from trainer.cli import build_parser, config_from_values, layout, parse_config
from trainer.config import SECTIONS
from trainer.errors import ConfigError, TaskError
from trainer.gradsync import SYNC_METHODS, DDPSync
from trainer.models import MODELS, ConvNet
from trainer.options import fields_of, option
from trainer.registry import Entry
from trainer.task import Task


def test_every_config_field_and_task_option_has_a_flag_with_help():
    _, task = parse_config([])
    parser = build_parser(task.spec)
    flags = {option for action in parser._actions for option in action.option_strings}
    for kind in [*SECTIONS.values(), task.spec.options_type]:
        for field in fields_of(kind):
            assert "--" + field.name.replace("_", "-") in flags
    assert all(action.help for action in parser._actions)


def test_flags_override_yaml_which_overrides_a_scripts_settings_which_override_defaults(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("optim:\n  lr: 0.01\n  optimizer: sgd\nepochs: 5\nbatch-size: 32\ntask:\n  model: lenet\n")
    settings = {"epochs": 7, "lr": 0.3, "seed": 4}
    config, task = parse_config(["--config", str(file), "--lr", "0.2", "--sync-bn"], settings=settings)
    assert config.optim.lr == 0.2 and config.optim.optimizer == "sgd"
    assert config.train.epochs == 5 and config.train.batch_size == 32 and config.model.sync_bn
    assert config.train.seed == 4 and task.options.model == "lenet"


def test_config_round_trips_through_its_yaml_layout():
    config, task = parse_config(["--model", "lenet", "--keep-last", "4", "--dataset", "synthetic"])
    assert config_from_values(task.spec, layout(config, task)) == (config, task)
    assert layout(config, task)["task"] == {**task.options_dict(), "name": "classification", "model": "lenet"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--keep-last", "1"], "--keep-last must be >= 2"),
    (["--synthetic-shape", "3,32"], "--synthetic-shape '3,32'"),
    (["--device", "cpu", "--precision", "fp16"], "fp16 needs a GPU"),
    (["--num-workers", "two"], "--num-workers 'two': auto or a number"),
    (["--model", "resnet1000"], "--model 'resnet1000': no such model; choose one of convnet, lenet"),
    (["--dataset", "imagenet"], "--dataset 'imagenet': no such dataset; choose one of fashion-mnist"),
    (["--sync", "carrier-pigeon"], "--sync 'carrier-pigeon': no such gradient synchronisation method"),
    (["--global-batch-size", "-8"], "--global-batch-size must be >= 0"),
    (["--global-batch-size", "24", "--scale-lr"], "--scale-lr multiplies the learning rate by the world size, but"),
    (["--global-batch-size", "24", "--grad-accum-steps", "5"], "--global-batch-size 24 does not divide into "
                                                                "--grad-accum-steps 5 micro-batches at any world size"),
])
def test_invalid_values_name_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv)


def test_a_global_batch_is_shared_out_at_every_world_size_or_refused_in_one_line_where_it_does_not_divide():
    config, _ = parse_config(["--global-batch-size", "24", "--grad-accum-steps", "2", "--batch-size", "5"])
    assert [config.train.per_rank_batch(world, 2) for world in (1, 2, 3, 4, 6, 12)] == [12, 6, 4, 3, 2, 1]
    with pytest.raises(ConfigError, match=r"^--global-batch-size 24 does not divide into 5 rank\(s\) x 2 "
                                          r"micro-batch\(es\) per step; give a multiple of 10 "):
        config.train.per_rank_batch(5, 2)
    with pytest.raises(ConfigError, match="does not divide into 24 rank"):
        config.train.per_rank_batch(24, 2)  # less than one sample each
    plain, _ = parse_config(["--batch-size", "5"])
    assert plain.train.per_rank_batch(7, 3) == 5  # without it, --batch-size per rank at any size


def test_yaml_errors_name_the_key(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("lr: fast\n")
    with pytest.raises(ConfigError, match="'lr' must be float"):
        parse_config(["--config", str(file)])
    file.write_text("learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="unknown config key 'learning_rate'"):
        parse_config(["--config", str(file)])
    file.write_text("data:\n  dataset: mnist\n")  # where format 2's configs had it
    with pytest.raises(ConfigError, match="'dataset' is in section 'data' but belongs under 'task:'"):
        parse_config(["--config", str(file)])
    with pytest.raises(ConfigError, match="no such file"):
        parse_config(["--config", str(tmp_path / "missing.yaml")])


def test_a_name_added_to_a_registry_alone_is_accepted_listed_and_built(monkeypatch):
    monkeypatch.setitem(MODELS._entries, "tiny", Entry("tiny", lambda c, s, n, p: ConvNet(c, s, n), "a test model"))
    monkeypatch.setitem(SYNC_METHODS._entries, "ddp2", Entry("ddp2", DDPSync, "a second name"))
    config, task = parse_config(["--model", "tiny", "--sync", "ddp2"])
    assert (task.options.model, config.train.sync) == ("tiny", "ddp2")
    help_text = build_parser(task.spec).format_help()
    assert "tiny" in help_text and "ddp2" in help_text


@dataclass
class WindowOptions:
    window: int = option(32, "input steps per sample")
    noise: float = option(0.1, "noise added to the inputs")


class WindowTask(Task[WindowOptions]):
    name = "window"
    Options = WindowOptions

    def datasets(self, context): ...

    def model(self, data): ...

    def loss(self, outputs, targets): ...


def test_a_tasks_options_are_flags_and_yaml_keys_of_their_own_section(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("task:\n  window: 8\nnoise: 0.5\nepochs: 2\n")
    config, task = parse_config(["--config", str(file), "--window", "16"], task=WindowTask)
    assert (task.options.window, task.options.noise, config.train.epochs) == (16, 0.5, 2)
    assert task.name == "window" and task.source.endswith(":WindowTask")
    assert "--window" in build_parser(task.spec, task_fixed=True).format_help()
    with pytest.raises(ConfigError, match="unknown config key 'model'"):
        parse_config([], task=WindowTask, settings={"model": "lenet"})  # the built-in task's, not this one's


def test_a_task_option_named_like_a_trainer_setting_is_refused():
    @dataclass
    class Clashing:
        lr: float = option(0.1, "the task's own learning rate")

    class ClashingTask(WindowTask):
        Options = Clashing

    with pytest.raises(TaskError, match="option lr has the name of one of the trainer's own settings"):
        parse_config([], task=ClashingTask)


def test_a_script_that_fixes_its_task_refuses_a_config_naming_another(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("task:\n  name: classification\n")
    with pytest.raises(ConfigError, match="the config names task 'classification', but this script trains its own"):
        parse_config(["--config", str(file)], task=WindowTask)


def test_a_setting_a_checkpoint_predates_counts_as_its_default_on_resume():
    """A checkpoint written before --global-batch-size existed trained without it: resuming with it is a change."""
    from trainer.config import TrainConfig
    from trainer.options import ResumeRule
    from trainer.resume import _differences

    older = {"epochs": 3, "batch_size": 128, "eval_batch_size": 512, "eval_every": 0, "max_steps": 0, "seed": 0,
             "sync": "ddp"}
    assert _differences(older, TrainConfig(), TrainConfig) == []
    assert _differences(older, TrainConfig(global_batch_size=24), TrainConfig) == [
        ("global_batch_size", 0, 24, ResumeRule.FLAG)]


def test_out_of_memory_under_a_global_batch_advises_accumulation_not_a_smaller_batch_size():
    from trainer.profiling import out_of_memory_message

    said = out_of_memory_message(RuntimeError("CUDA out of memory. Tried"), 2, None, global_batch=True)
    assert "; raise --grad-accum-steps (each micro-batch shrinks, the step stays --global-batch-size), " in said
    assert "--batch-size" not in said


@pytest.mark.parametrize(("argv", "flag"), [(["--conf", "{file}"], "config"), (["--con={file}"], "config"),
                                            (["--tas", "classification"], "task")])
def test_a_shortened_config_or_task_flag_is_refused_not_silently_left_out(argv, flag, tmp_path):
    """The full parser would take --conf as --config, but the file is read before it, by name: it was dropped."""
    config_file = tmp_path / "c.yaml"
    config_file.write_text("epochs: 7\n")
    with pytest.raises(ConfigError, match=f"^a shortened --{flag} flag is not read: write --{flag} in full$"):
        parse_config([arg.format(file=config_file) for arg in argv])
    assert parse_config(["--config", str(config_file)])[0].train.epochs == 7
