"""--sync fsdp/hsdp's rules that need no process group: the default sharding units, the task's own units and
their errors, --meta-init's refusals, and how a sharded checkpoint's rows are put back together."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.checkpoint.shards import MARK, ShardSource, fit
from trainer.config import Config, ModelConfig, TrainConfig
from trainer.errors import ConfigError, TaskError
from trainer.gradsync import SyncOptions
from trainer.sharding import (
    FSDPSync,
    compute_norms_in_fp32,
    default_units,
    initialise_in_order,
    initialise_on_device,
    registration_order,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(2, 2)
        self.blocks = nn.Sequential(Block(), nn.ReLU(), Block())
        self.head = nn.Linear(2, 1)


def test_batchnorms_computing_in_fp32_share_one_class_per_kind_keep_a_users_forward_and_take_a_second_call():
    """One class for all of a kind (compile guards forward by identity), a user's BatchNorm subclass still its own,
    state dicts as before, and a model changed twice changed once (not a class built over its own subclass)."""

    class Scaled(nn.BatchNorm2d):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return super().forward(input) * 2

    model = nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(3), Scaled(3), nn.BatchNorm1d(3))
    keys = list(model.state_dict())
    assert compute_norms_in_fp32(model, torch.bfloat16) == 4
    kinds = [type(norm) for norm in model]
    assert kinds[0] is kinds[1] and len(set(kinds)) == 3 and isinstance(model[2], Scaled)
    assert list(model.state_dict()) == keys
    image = torch.randn(2, 3, 4, 4, dtype=torch.bfloat16)
    out = model[2](image)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, model[0](image) * 2)  # train mode: batch statistics, the same weights
    assert compute_norms_in_fp32(model, torch.float16) == 4
    assert [type(norm) for norm in model] == kinds and model[3].fp32_output_dtype == torch.float16


def test_default_units_are_the_children_of_every_stack_that_hold_parameters():
    model = Net()
    units = default_units(model)
    names = {module: name for name, module in model.named_modules()}
    assert [names[unit] for unit in units] == ["blocks.0", "blocks.2", "blocks.0.inner.0", "blocks.0.inner.1",
                                               "blocks.2.inner.0", "blocks.2.inner.1"]


def test_a_plain_layer_has_no_units_but_the_root():
    assert default_units(nn.Linear(3, 3)) == []


def units_of(model: nn.Module, chooser) -> list[nn.Module]:
    return FSDPSync(None, SyncOptions(units=chooser, owner="task 'net'"))._units(model)  # type: ignore[arg-type]


def test_a_tasks_units_replace_the_rule():
    model = Net()
    assert units_of(model, lambda m: [m.blocks[0], m.blocks[2], m.blocks[0]]) == [model.blocks[0], model.blocks[2]]


@pytest.mark.parametrize(("chooser", "message"), [
    (lambda m: [], "task 'net': shard_units(model) matched no module; return the model's repeated blocks, or "
                   "remove shard_units to use the default rule (docs/tasks.md)"),
    (lambda m: [nn.Linear(1, 1)], "task 'net': shard_units(model) returned Linear, not a submodule of the model "
                                  "(the root is always a unit of its own)"),
    (lambda m: [m], "returned Net, not a submodule of the model"),
    (lambda m: "blocks", "shard_units(model) must return a list of the model's modules, got str"),
])
def test_units_that_cannot_be_sharded_are_one_line(chooser, message):
    with pytest.raises(TaskError) as raised:
        units_of(Net(), chooser)
    assert message in str(raised.value)


def test_meta_init_refuses_a_module_it_cannot_initialise_before_allocating_anything():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(TaskError) as raised:
        initialise_on_device(model, torch.device("cpu"), None, "task 'scaled'")
    assert str(raised.value) == ("task 'scaled': --meta-init builds the model without weights, and module(s) "
                                 "1 (Scale) own parameters or buffers but have no reset_parameters(); give the task an "
                                 "init_weights(module) (docs/tasks.md) or pass --meta-init off")
    assert model[0].weight.is_meta  # nothing allocated


def test_meta_init_with_a_tasks_init_weights_and_no_sharding_gives_each_module_its_weights():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))

    def init_weights(module: nn.Module) -> None:
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            tensor.fill_(7)

    held = initialise_on_device(model, torch.device("cpu"), init_weights, "task 'x'")
    assert all(bool((tensor == 7).all()) for tensor in [*model.parameters(), *model.buffers()])
    assert held == sum(tensor.nbytes for tensor in [*model.parameters(), *model.buffers()])


class ScaledLinear(nn.Module):
    """A Linear child made first, then a parameter of its own: a plain build draws the child's weights first."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.empty(3))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.scale)


def built(meta: bool) -> tuple[nn.Module, list[nn.Module]]:
    torch.manual_seed(5)
    with registration_order() as order, torch.device("meta") if meta else torch.device("cpu"):
        model = nn.Sequential(nn.Linear(3, 3), ScaledLinear())
    return model, order


def assert_same_weights(model: nn.Module, expected: nn.Module) -> None:
    for (name, wanted), (_, tensor) in zip(expected.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(tensor, wanted), name


def test_meta_init_draws_in_the_order_a_plain_build_does():
    plain, _ = built(meta=False)
    meta, order = built(meta=True)
    torch.manual_seed(5)
    initialise_on_device(meta, torch.device("cpu"), None, "task 'x'", order)
    assert_same_weights(meta, plain)


def test_a_tasks_init_weights_gives_a_plain_build_the_weights_meta_init_gives():
    def init_weights(module: nn.Module) -> None:
        for tensor in module.parameters(recurse=False):
            nn.init.uniform_(tensor, -1, 1)

    plain, plain_order = built(meta=False)
    torch.manual_seed(9)
    initialise_in_order(plain, init_weights, plain_order)
    meta, order = built(meta=True)
    torch.manual_seed(9)
    initialise_on_device(meta, torch.device("cpu"), init_weights, "task 'x'", order)
    assert_same_weights(meta, plain)


def test_meta_init_on_needs_a_sharded_sync():
    with pytest.raises(ConfigError) as raised:
        Config(model=ModelConfig(meta_init="on"), train=TrainConfig(sync="ddp"))
    assert str(raised.value) == ("--meta-init on builds the model in shards, which --sync ddp does not keep; use "
                                 "--sync fsdp or hsdp, or --meta-init off")


def marker(path: str, shape: list[int]) -> dict:
    return {MARK: path, "shape": shape, "dtype": "float32"}


def source_of(files: dict[str, dict[str, tuple[int, torch.Tensor]]]) -> ShardSource:
    """Shard files held in memory: {filename: {path: (first row, rows)}}."""
    layout = {"files": {name: {path: [first, len(rows)] for path, (first, rows) in held.items()}
                        for name, held in files.items()}}
    loaded = {name: {path: rows for path, (_, rows) in held.items()} for name, held in files.items()}
    source = ShardSource(layout, lambda name: b"")
    source._loaded = loaded  # what _file would have read
    return source


def test_a_whole_tensor_is_put_together_from_the_rows_of_every_file():
    full = torch.arange(21.0).reshape(7, 3)
    source = source_of({"a": {"/w": (0, full[:3])}, "b": {"/w": (3, full[3:6])}, "c": {"/w": (6, full[6:])}})
    saved = {"model": {"w": marker("/w", [7, 3]), "step": torch.tensor(4.0)}}
    restored = fit(saved, None, source)
    assert torch.equal(restored["model"]["w"], full) and torch.equal(restored["model"]["step"], torch.tensor(4.0))
    assert torch.equal(source.rows(marker("/w", [7, 3]), 2, 3), full[2:5])  # rows across two files


def test_rows_no_file_holds_are_an_error_not_zeros():
    source = source_of({"a": {"/w": (0, torch.zeros(3, 2))}})
    with pytest.raises(ValueError, match=r"the checkpoint's shard files hold 3 of rows 0\.\.5 of /w"):
        fit(marker("/w", [5, 2]), None, source)


def test_a_0d_parameter_under_fsdp_is_one_line_naming_it():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)
            self.temperature = nn.Parameter(torch.tensor(1.0))

    with pytest.raises(TaskError) as raised:
        FSDPSync(None, SyncOptions(owner="task 'scaled'")).wrap(Scaled())  # type: ignore[arg-type]
    assert str(raised.value) == (
        "task 'scaled': --sync fsdp shards each parameter along its first dimension, and temperature is 0-d; make it "
        "a 1-element tensor (nn.Parameter(torch.ones(1)) instead of torch.tensor(1.0)), or train with --sync ddp")
