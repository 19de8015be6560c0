"""Metrics over batches, reduced across ranks: the training windows between log lines, and evaluation.

Each rank updates its metric states on the device every batch (no value is read back, so the CPU
never waits for a GPU); ``compute`` then reduces every state across ranks, at most one all-reduce per
kind of reduction, and reads the values once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader

from trainer.distributed import Runtime, largest
from trainer.errors import TaskError
from trainer.gradsync import broadcast_buffers, unwrap
from trainer.metrics import REDUCTIONS, Mean, Metric
from trainer.task import batch_size, to_device

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class MetricSet:
    """The mean of the task's loss (as "loss"), the task's metrics, and the number of samples."""

    def __init__(self, metrics: Mapping[str, Any], device: torch.device, owner: str = "") -> None:
        self.owner = owner  # who the metrics are, for messages: "task 'forecast' (forecast:Forecast)"
        self.loss = Mean().to(device)
        self.metrics = dict(metrics)
        for metric in self.metrics.values():
            metric.to(device)
        self.device = device

    def update(self, loss: Tensor, outputs: Any, targets: Any) -> None:
        self.loss.update(loss, batch_size(targets))
        for metric in self.metrics.values():
            metric.update(outputs, targets)

    def compute(self, runtime: Runtime, reduce: bool = True) -> dict[str, float]:
        """Every value, reduced across ranks: a collective, every rank calls it at the same point.

        ``reduce=False`` computes this rank's values alone (the first-batch check, where ranks may
        not all get this far).
        """
        ours: list[Metric] = [self.loss, *(m for m in self.metrics.values() if isinstance(m, Metric))]
        if reduce and runtime.identity.world_size > 1:
            _all_reduce_states(ours)
        values = {"loss": self._number("loss", self.loss.compute()),
                  "samples": int(self.loss.state["count"].item())}
        for name, metric in self.metrics.items():
            if isinstance(metric, Metric):
                values[name] = self._number(name, metric.compute())
            else:  # a torchmetrics metric synchronises its own states when asked to compute
                sync = metric.sync_on_compute
                metric.sync_on_compute = reduce
                try:
                    values[name] = self._number(name, metric.compute())
                finally:
                    metric.sync_on_compute = sync
        self.reset()
        return values

    def reset(self) -> None:
        for metric in [self.loss, *self.metrics.values()]:
            metric.reset()

    def _number(self, name: str, value: Any) -> float:
        where = f"{self.owner}: " if self.owner else ""
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise TaskError(f"{where}metric {name!r} computed a tensor of shape {list(value.shape)}; a metric's "
                                f"value must be one number")
            return float(value.item())
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise TaskError(f"{where}metric {name!r} computed a {type(value).__name__}; a metric's value must be one "
                        f"number")


def _all_reduce_states(metrics: list[Metric]) -> None:
    for reduction in REDUCTIONS:
        states = [(metric, name) for metric in metrics for name, how in metric.reductions.items() if how == reduction]
        if not states:
            continue
        flat = torch.cat([metric.state[name].reshape(-1).double() for metric, name in states])
        dist.all_reduce(flat, op=OPS[reduction])
        offset = 0
        for metric, name in states:
            size = metric.state[name].numel()
            metric.state[name] = flat[offset:offset + size].reshape(metric.state[name].shape)
            offset += size


def evaluate(model: nn.Module, loader: DataLoader[Any], task: Any, metrics: MetricSet, runtime: Runtime,
             autocast: Callable[[], AbstractContextManager[object]],
             inputs_on_device: Callable[[Any], Any] | None = None, lockstep: bool = False) -> dict[str, float]:
    """Every evaluation sample counted exactly once: each rank scores its own shard (no padding), then the
    states are reduced. Ranks may have different batch counts, so no collective runs inside the loop, and
    the plain module is used (DDP's forward would broadcast buffers).

    ``lockstep``: the model's forward pass is itself collective (a sharded model gathers its parameters), so
    every rank runs as many as the rank with the most batches; the extra ones run on a batch already scored
    (or, on a rank with none, the dataset's first item) and count in no metric."""
    broadcast_buffers(model, runtime)
    plain = unwrap(model)
    plain.eval()
    spare = None
    batches = 0
    # Agreed before the first forward: a rank still in its own batches would wait in a gather meanwhile.
    most = largest(len(loader), runtime) if lockstep else 0
    with torch.no_grad():
        for inputs, targets in loader:
            inputs = inputs_on_device(inputs) if inputs_on_device else to_device(inputs, runtime.device)
            targets = to_device(targets, runtime.device)
            with autocast():
                outputs = plain(inputs)
                loss = task.loss(outputs, targets)
            metrics.update(loss.detach(), detached(outputs), targets)
            spare, batches = inputs, batches + 1
        if lockstep:
            for _ in range(most - batches):
                if spare is None:
                    first = loader.collate_fn(loader.dataset.__getitems__([0]))  # type: ignore[attr-defined]
                    spare = inputs_on_device(first[0]) if inputs_on_device else to_device(first[0], runtime.device)
                with autocast():
                    plain(spare)
    plain.train()
    return metrics.compute(runtime)


def detached(outputs: Any) -> Any:
    if isinstance(outputs, Tensor):
        return outputs.detach()
    if isinstance(outputs, Mapping):
        return {key: detached(value) for key, value in outputs.items()}
    if isinstance(outputs, list | tuple) and not hasattr(outputs, "_fields"):
        return type(outputs)(detached(value) for value in outputs)
    return outputs
