"""How gradients are synchronised: DDP, or the classic tutorials' hand-written methods, to compare.

All methods produce the average of the ranks' gradients; they differ in how many messages they
send and whether communication overlaps the backward pass (only DDP does: bucketed all-reduces
start while later layers are still computing gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from trainer.distributed import Runtime
from trainer.errors import ConfigError
from trainer.rng import capture_rng, restore_rng
from trainer.seams import SYNC_METHODS

__all__ = ["SYNC_METHODS", "GradSync", "SyncOptions", "build_grad_sync", "unwrap"]


@dataclass(frozen=True)
class SyncOptions:
    """What a method may need beyond the process group: the run's precision (sharded methods gather parameters
    in it), and the task's own choice of sharding units (``shard_units(model)``, None: the method's rule)."""

    precision: str = "fp32"
    units: Callable[[nn.Module], Any] | None = None
    owner: str = "the task"  # who chose the units, for messages


class GradSync:
    """Base: wrap the model once, then call ``no_sync`` on non-final micro-steps and
    ``after_backward`` after the final one."""

    name = "none"
    one_process = False  # all the node's devices in one process: nothing for SyncBatchNorm to synchronise
    # Parameters sharded across ranks (trainer.sharding): every forward is collective, so every rank runs the
    # same number of them, and checkpoints are written by every rank.
    sharded = False

    def __init__(self, runtime: Runtime, options: SyncOptions | None = None) -> None:
        self.runtime = runtime
        self.options = options or SyncOptions()

    def describe(self) -> str:
        return ""

    def wrap(self, model: nn.Module) -> nn.Module:
        broadcast_state(model, self.runtime)
        return model

    def no_sync(self, model: nn.Module) -> AbstractContextManager[object]:
        return nullcontext()

    def prime(self, model: nn.Module, first_loss: Callable[[], torch.Tensor]) -> None:
        """Once per process, before the first step, given the loss of the first batch: settle whatever
        would otherwise change after the first step. Changes no parameter, buffer or random state."""

    def after_backward(self, model: nn.Module) -> None:
        """Average the gradients across ranks (in place)."""


class DDPSync(GradSync):
    """PyTorch's DistributedDataParallel: bucketed all-reduces overlapping the backward pass."""

    name = "ddp"

    def __init__(self, runtime: Runtime, options: SyncOptions | None = None, bucket_mb: float = 25.0) -> None:
        super().__init__(runtime, options)
        self.bucket_mb = bucket_mb

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.runtime.identity.world_size == 1:
            return model  # nothing to synchronise: DDP's hooks and its all-reduce of one would be pure cost
        device_ids = [self.runtime.device] if self.runtime.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers on construction.
        return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=self.bucket_mb,
                                       gradient_as_bucket_view=True)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[object]:
        return model.no_sync() if isinstance(model, DistributedDataParallel) else nullcontext()

    def prime(self, model: nn.Module, first_loss: Callable[[], torch.Tensor]) -> None:
        """Fix DDP's gradient buckets before the first step, so that every step of every process reduces
        each gradient at the same place in the same bucket.

        DDP reduces the first backward in one bucket in parameter order, then rebuilds its buckets in the
        order the gradients became ready. Where a gradient sits decides the order in which gloo's ring (and
        NCCL) adds up the ranks' values, and with three ranks or more a different order changes the last bits.
        A resumed process would reduce its first step in the first layout where the uninterrupted run used the
        rebuilt one, and end with other parameters. So each process records the order here, with one backward
        of the first batch's loss times zero; the model's buffers (BatchNorm's statistics) and the random
        generators are put back, and the zero gradients dropped. Cost: one forward and backward at start.
        """
        ddp = _ddp_inside(model)
        if ddp is None:
            return
        buffers = [buffer.detach().clone() for buffer in ddp.module.buffers()]
        generators = capture_rng()
        try:
            (first_loss() * 0).backward()
        finally:
            restore_rng(generators)
            with torch.no_grad():
                for buffer, kept in zip(ddp.module.buffers(), buffers, strict=True):
                    buffer.copy_(kept)
            ddp.zero_grad(set_to_none=True)


class AllReduceSync(GradSync):
    """The tutorial's method: after backward, one all-reduce per parameter, then divide."""

    name = "allreduce"

    def after_backward(self, model: nn.Module) -> None:
        world_size = self.runtime.identity.world_size
        for parameter in model.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)
                parameter.grad.div_(world_size)


class ReduceBroadcastSync(GradSync):
    """Parameter-server style: reduce every gradient to rank 0, average there, broadcast back."""

    name = "reduce-broadcast"

    def after_backward(self, model: nn.Module) -> None:
        world_size = self.runtime.identity.world_size
        for parameter in model.parameters():
            if parameter.grad is None:
                continue
            dist.reduce(parameter.grad, dst=0, op=dist.ReduceOp.SUM)
            if self.runtime.is_main:
                parameter.grad.div_(world_size)
            dist.broadcast(parameter.grad, src=0)


class DataParallelSync(GradSync):
    """Single-process DataParallel over the node's GPUs (the oldest tutorial); plain model on CPU."""

    name = "dp"
    one_process = True

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.runtime.identity.world_size != 1:
            raise ConfigError(
                f"--sync dp runs one process over all local GPUs, but the world size is "
                f"{self.runtime.identity.world_size}; start one process (python -m trainer) or use --sync ddp"
            )
        if self.runtime.device.type == "cuda" and torch.cuda.device_count() > 1:
            return DataParallel(model)
        return model


SYNC_METHODS.add(DDPSync.name, DDPSync, "DistributedDataParallel, overlapping communication with backward")
SYNC_METHODS.add(AllReduceSync.name, AllReduceSync, "one all-reduce per parameter after backward")
SYNC_METHODS.add(ReduceBroadcastSync.name, ReduceBroadcastSync, "reduce to rank 0, then broadcast")
SYNC_METHODS.add(DataParallelSync.name, DataParallelSync, "one process over all local GPUs (DataParallel)")


def build_grad_sync(name: str, runtime: Runtime, options: SyncOptions | None = None) -> GradSync:
    return SYNC_METHODS.get(name)(runtime, options)


def layers(model: nn.Module) -> Iterator[nn.Module]:
    """The model, then each module it wraps, outermost first: torch.compile's, DDP's or DataParallel's."""
    while True:
        yield model
        if isinstance(model, DistributedDataParallel | DataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod  # torch.compile's OptimizedModule
        else:
            return


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP, DataParallel or torch.compile wrappers: what checkpoints hold."""
    *_, plain = layers(model)
    return plain


def _ddp_inside(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper of a model that may also be compiled (torch.compile wraps DDP, see trainer.build)."""
    return next((layer for layer in layers(model) if isinstance(layer, DistributedDataParallel)), None)


def broadcast_state(model: nn.Module, runtime: Runtime) -> None:
    """Give every rank rank 0's parameters and buffers (what DDP does on construction)."""
    if runtime.identity.world_size == 1:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def broadcast_buffers(model: nn.Module, runtime: Runtime) -> None:
    """Rank 0's BatchNorm running statistics everywhere, so that every rank evaluates the same model.

    Each rank updates its running statistics with its own batches; DDP only re-broadcasts them at
    the start of the next training forward.
    """
    if runtime.identity.world_size == 1:
        return
    with torch.no_grad():
        for buffer in unwrap(model).buffers():
            dist.broadcast(buffer.data, src=0)
