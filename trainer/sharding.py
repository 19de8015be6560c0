"""Sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``): each rank keeps 1/N of the
parameters, their gradients and the optimizer's state, and gathers one sharding unit at a time, just in time
for its forward and backward (the next unit's gather is prefetched while the current one computes).

``--sync fsdp`` shards over every rank; ``--sync hsdp`` shards within a node and replicates across nodes (a
2-D mesh: the gathers stay on the node's fast links, and only the gradients' reduction crosses nodes).

Units: by default the repeated blocks of the model, the children of each ``nn.ModuleList`` and
``nn.Sequential`` that hold parameters (a transformer's layers, a ResNet's stages), then the root for what is
left. A task may name its own with ``shard_units(model)`` (docs/tasks.md).

A model too large for one rank is built on the meta device (``--meta-init``), sharded, and only then given
memory: each rank allocates its own shards. Its weights are initialised module by module, each module's own
tensors materialised in full, in host memory, for the moment of its initialisation (a layer, never the model),
in the order the model's build registered them (``registration_order``): the order a plain build draws them in.
So the sharded model starts with exactly the weights a plain build would have given, at any world size; and a
task's ``init_weights`` is applied in that order by a plain build too (``initialise_in_order``), so every
``--sync`` starts a task from the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from trainer.distributed import Runtime
from trainer.errors import ConfigError, TaskError
from trainer.gradsync import GradSync, SyncOptions, layers
from trainer.seams import SYNC_METHODS

__all__ = ["FSDPSync", "HSDPSync", "default_units", "initialise_in_order", "initialise_on_device", "local_rows",
           "registration_order"]

REDUCED_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


class FSDPSync(GradSync):
    """Parameters, gradients and optimizer state sharded over all ranks (ZeRO-3)."""

    name = "fsdp"
    sharded = True

    def __init__(self, runtime: Runtime, options: SyncOptions | None = None) -> None:
        super().__init__(runtime, options)
        self.mesh: DeviceMesh | None = None
        self.units: list[str] = []  # the sharding units' names in the model, for the log and the tests
        self.fp32_norms = 0  # BatchNorm layers computing in fp32 inside their units under a reduced --precision
        self.reshard_after_forward = True  # False where each shard group has one rank (see wrap)

    def device_mesh(self) -> DeviceMesh:
        return init_device_mesh(self.runtime.device.type, (self.runtime.identity.world_size,),
                                mesh_dim_names=("shard",))

    def wrap(self, model: nn.Module) -> nn.Module:
        if not any(parameter.requires_grad for parameter in model.parameters()):
            raise TaskError(f"--sync {self.name}: the model has no trainable parameters to shard")
        scalars = [name for name, parameter in model.named_parameters() if parameter.dim() == 0]
        if scalars:
            raise TaskError(f"{self.options.owner}: --sync {self.name} shards each parameter along its first "
                            f"dimension, and {', '.join(scalars[:5])} {'is' if len(scalars) == 1 else 'are'} 0-d; "
                            f"make it a 1-element tensor (nn.Parameter(torch.ones(1)) instead of torch.tensor(1.0)), "
                            f"or train with --sync ddp")
        self.mesh = self.device_mesh()
        units = self._units(model)
        policy = _policy(self.options.precision)
        names = {module: name for name, module in model.named_modules()}
        if policy.param_dtype is not None:
            # BatchNorm's running statistics are fp32 buffers, which the policy does not cast, and its statistics
            # want fp32 arithmetic. Each BatchNorm stays in its block's unit (gathered with the block, in the
            # reduced type: no collective of its own) and computes in fp32 from there (compute_norms_in_fp32).
            self.fp32_norms = compute_norms_in_fp32(model, policy.param_dtype)
        # In a shard group of one rank a unit's shard is the whole of it: resharding after the forward would free
        # only the gathered copy (under a reduced --precision, the parameters in that type: half their fp32
        # bytes, ResNet-50's 50 MB) and cost a copy per unit to make it again for the backward. Kept gathered.
        self.reshard_after_forward = self.mesh.size(self.mesh.ndim - 1) > 1
        reshard = None if self.reshard_after_forward else False  # None: FSDP's own rule (the root's kept)
        # Innermost first: a unit inside another unit is sharded on its own, and the outer one keeps the rest.
        for module in sorted(units, key=lambda unit: -names[unit].count(".")):
            fully_shard(module, mesh=self.mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=self.mesh, mp_policy=policy, reshard_after_forward=reshard)
        self.units = [names[unit] for unit in units]
        return model

    def _units(self, model: nn.Module) -> list[nn.Module]:
        chooser = self.options.units
        if chooser is None:
            return default_units(model)
        chosen = chooser(model)
        inside = {id(module) for module in model.modules()}
        if not isinstance(chosen, list | tuple) or not all(isinstance(unit, nn.Module) for unit in chosen):
            raise TaskError(f"{self.options.owner}: shard_units(model) must return a list of the model's modules, "
                            f"got {type(chosen).__name__}")
        if not chosen:
            raise TaskError(f"{self.options.owner}: shard_units(model) matched no module; return the model's "
                            f"repeated blocks, or remove shard_units to use the default rule (docs/tasks.md)")
        strangers = [type(unit).__name__ for unit in chosen if id(unit) not in inside or unit is model]
        if strangers:
            raise TaskError(f"{self.options.owner}: shard_units(model) returned {', '.join(strangers)}, not a "
                            f"submodule of the model (the root is always a unit of its own)")
        return list(dict.fromkeys(chosen))

    def no_sync(self, model: nn.Module) -> AbstractContextManager[object]:
        return _without_gradient_sync(model)

    def describe(self) -> str:
        shape = "x".join(map(str, self.mesh.shape)) if self.mesh is not None else "?"
        norms = f" ({self.fp32_norms} BatchNorm layer(s) computing in fp32)" if self.fp32_norms else ""
        kept = "" if self.reshard_after_forward else ", kept gathered from forward to backward (one rank per shard)"
        return f"{len(self.units)} unit(s) and the root{norms}, mesh {shape}{kept}"


class HSDPSync(FSDPSync):
    """Sharded within each node, replicated across nodes: a (nodes x ranks per node) mesh."""

    name = "hsdp"

    def device_mesh(self) -> DeviceMesh:
        identity = self.runtime.identity
        per_node = identity.local_world_size
        if per_node < 1 or identity.world_size % per_node:
            raise ConfigError(f"--sync hsdp shards within a node: the world size {identity.world_size} is not a "
                              f"multiple of the ranks per node ({per_node}); start the same number on every node")
        return init_device_mesh(self.runtime.device.type, (identity.world_size // per_node, per_node),
                                mesh_dim_names=("replicate", "shard"))


SYNC_METHODS.add(FSDPSync.name, FSDPSync, "sharded parameters, gradients and optimizer state (FSDP2)")
SYNC_METHODS.add(HSDPSync.name, HSDPSync, "sharded within a node, replicated across nodes (FSDP2, 2-D mesh)")


def default_units(model: nn.Module) -> list[nn.Module]:
    """The children of every ``nn.ModuleList`` and ``nn.Sequential`` in the model that hold parameters."""
    units = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList | nn.Sequential):
            units.extend(child for child in module.children() if any(True for _ in child.parameters()))
    return [unit for unit in dict.fromkeys(units) if unit is not model]


def compute_norms_in_fp32(model: nn.Module, output_dtype: torch.dtype) -> int:
    """Every BatchNorm of the model computes in fp32 and hands the next layer ``output_dtype``, as autocast has
    it on CUDA. Its parameters arrive gathered in the unit's reduced type (their fp32 master copy is the sharded
    one the optimizer updates) and are cast up for the computation; gradients flow back through the casts. The
    input stays as it comes (reduced): batch norm's mixed-type kernels (cuDNN's, the CPU's) take a bf16 or fp16
    input with fp32 parameters and compute the statistics in fp32, which is how BatchNorm runs under autocast
    with DDP. An fp32 copy of each input, saved for the backward, would hold twice the bytes of every norm's
    input through the step, and cost a cast each way. A unit of its own per BatchNorm would keep the parameters
    fp32 but cost two all-gathers and a reduce-scatter per layer and step (ResNet-50: 53 layers). Returns the
    number of layers changed."""
    norms = [module for module in model.modules() if isinstance(module, _BatchNorm)]
    # One class per BatchNorm class, shared by its layers: torch.compile guards a module's forward by identity,
    # so a callable of its own per layer would compile each block again (a ResNet's blocks share one code
    # object) until dynamo gives up on the rest and runs them eagerly, or turns to dynamic shapes.
    classes: dict[type, type] = {}
    for norm in norms:
        kind = type(norm)
        if isinstance(norm, _Fp32Compute):  # changed already (the model wrapped a second time): the type only
            norm.fp32_output_dtype = output_dtype
            continue
        if kind not in classes:
            classes[kind] = type(kind.__name__, (_Fp32Compute, kind), {"__module__": kind.__module__})
        norm.__class__ = classes[kind]
        norm.fp32_output_dtype = output_dtype
    return len(norms)


class _Fp32Compute:
    """Put before a BatchNorm class: its own forward, run with fp32 copies of the parameters FSDP gathered, on
    its input as it comes, handing the next layer ``fp32_output_dtype``."""

    fp32_output_dtype: torch.dtype
    _parameters: dict[str, nn.Parameter | None]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        gathered = {name: value for name, value in self._parameters.items() if value is not None}
        try:
            for name, value in gathered.items():
                self._parameters[name] = value.float()  # type: ignore[assignment]
            with torch.autocast(input.device.type, enabled=False):
                return super().forward(input).to(self.fp32_output_dtype)  # type: ignore[misc]
        finally:
            self._parameters.update(gathered)  # FSDP's own parameters, for its reshard after the unit's forward


def _policy(precision: str) -> MixedPrecisionPolicy:
    """--precision bf16/fp16: parameters gathered in that type for compute, gradients reduced in fp32."""
    if precision in REDUCED_PRECISION:
        return MixedPrecisionPolicy(param_dtype=REDUCED_PRECISION[precision], reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


@contextmanager
def _without_gradient_sync(model: nn.Module) -> Iterator[None]:
    """A non-final micro-step: gradients accumulate unsharded-reduced on each rank (no reduce-scatter)."""
    fsdp = _fsdp_inside(model)
    if fsdp is None:
        yield
        return
    fsdp.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        fsdp.set_requires_gradient_sync(True)


def _fsdp_inside(model: nn.Module) -> FSDPModule | None:
    """The FSDP root of a model that may also be compiled (torch.compile wraps it, see trainer.build)."""
    return next((layer for layer in layers(model) if isinstance(layer, FSDPModule)), None)


def local_rows(tensor: DTensor) -> tuple[int, int]:
    """The rows of the full tensor that this rank's shard holds: (first, count). FSDP2 shards dim 0 only."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if any(offset[1:]) or tuple(shape[1:]) != tuple(tensor.shape[1:]):
        raise ValueError(f"a tensor sharded on a dimension other than 0 ({tensor.placements})")
    return int(offset[0]) if offset else 0, int(shape[0]) if shape else 1


@contextmanager
def registration_order() -> Iterator[list[nn.Module]]:
    """The modules built inside the block, in the order each registered its first parameter or buffer. A plain
    build draws a module's weights in its constructor, once its tensors exist: a block that makes a Linear child
    and then a parameter of its own draws the child's first, one that makes its parameter first draws it first.
    (``model.modules()`` visits the parent first either way.) Torch's registration hooks are process-wide: they
    are removed when the block ends."""
    order: list[nn.Module] = []
    seen: set[int] = set()

    def registered(module: nn.Module, _: str, tensor: Any) -> None:
        if tensor is not None and id(module) not in seen:
            seen.add(id(module))
            order.append(module)

    handles = [register_module_parameter_registration_hook(registered),
               register_module_buffer_registration_hook(registered)]
    try:
        yield order
    finally:
        for handle in handles:
            handle.remove()


def initialise_in_order(model: nn.Module, init: Callable[[nn.Module], None], order: list[nn.Module]) -> None:
    """A plain build's weights given by the task's ``init_weights(module)``, each module in ``order``: the draws a
    meta-built model's initialisation makes, in the same order (call it right after seeding as that does)."""
    with torch.no_grad():
        for module in _in_order(model, order):
            init(module)


def _in_order(model: nn.Module, order: list[nn.Module]) -> list[nn.Module]:
    """The model's modules that own tensors, in registration order; any the hooks did not see (tensors placed in
    ``_parameters`` by hand) after them, in the model's own order."""
    owning = [module for module in model.modules() if _owns_tensors(module)]
    inside = {id(module) for module in owning}
    listed = [module for module in order if id(module) in inside]
    known = {id(module) for module in listed}
    return listed + [module for module in owning if id(module) not in known]


def initialise_on_device(model: nn.Module, device: torch.device, init: Callable[[nn.Module], None] | None,
                         owner: str, order: list[nn.Module] | None = None) -> int:
    """Give a meta-built, sharded model memory on ``device`` (its own shards only) and initialise every module
    that owns tensors, in ``order`` (registration_order's, from the build): the task's ``init_weights(module)``,
    else the module's ``reset_parameters()``. Each module's sharded parameters are materialised in full in host
    memory while it is initialised (the same random draws, from the same generator, in the same order, as a plain
    build), then cut to this rank's rows. Returns the bytes this rank allocated."""
    missing = [f"{name or 'the root'} ({type(module).__name__})" for name, module in model.named_modules()
               if _owns_tensors(module) and init is None and not hasattr(module, "reset_parameters")]
    if missing:
        raise TaskError(f"{owner}: --meta-init builds the model without weights, and module(s) "
                        f"{', '.join(missing[:5])} own parameters or buffers but have no reset_parameters(); give "
                        f"the task an init_weights(module) (docs/tasks.md) or pass --meta-init off")
    model.to_empty(device=device)
    with torch.no_grad():
        for module in _in_order(model, order or []):
            _initialise_module(module, init or _reset)
    return sum(_local(tensor).nbytes for tensor in [*model.parameters(), *model.buffers()])


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def _reset(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def _initialise_module(module: nn.Module, init: Callable[[nn.Module], None]) -> None:
    sharded = {name: parameter for name, parameter in module._parameters.items() if isinstance(parameter, DTensor)}
    for name, parameter in sharded.items():
        # On the host: a plain build draws on the CPU's generator (a CUDA one gives other numbers).
        full = torch.empty(parameter.shape, dtype=parameter.dtype, device="cpu")
        module._parameters[name] = nn.Parameter(full, requires_grad=parameter.requires_grad)
    try:
        init(module)
        for name, parameter in sharded.items():
            first, count = local_rows(parameter)
            _local(parameter).copy_(module._parameters[name].detach()[first:first + count])  # type: ignore[index]
    finally:
        for name, parameter in sharded.items():
            module._parameters[name] = parameter  # FSDP's own sharded parameter, as it was registered


def _local(tensor: Any) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
