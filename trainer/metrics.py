"""Evaluation metrics as reductions across ranks, so that a metric is exact at any world size.

A ``Metric`` keeps running sums (or maxima, minima) as tensors; after every rank has seen its shard,
the trainer reduces each state across ranks once and calls ``compute()``. Because evaluation gives
each sample to exactly one rank, the reduced sums are those of one process that saw every sample.

A ``torchmetrics.Metric`` works as a task metric too: torchmetrics declares a reduction for each of
its states (``dist_reduce_fx``) and synchronises them itself when ``compute()`` is called.

Writing one (an average over samples: ``Average`` below does the bookkeeping)::

    class MaxError(Metric):
        def __init__(self) -> None:
            super().__init__()
            self.add_state("worst", 0.0, reduce="max")

        def update(self, outputs, targets):
            self.state["worst"] = torch.maximum(self.state["worst"], (outputs - targets).abs().max())

        def compute(self):
            return self.state["worst"]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

__all__ = ["REDUCTIONS", "Accuracy", "Average", "Mean", "MeanAbsoluteError", "Metric", "RootMeanSquaredError"]

REDUCTIONS = ("sum", "max", "min")


class Metric(ABC):
    """A metric whose states are tensors with a declared reduction: "sum", "max" or "min"."""

    def __init__(self) -> None:
        self.state: dict[str, Tensor] = {}
        self._initial: dict[str, Tensor] = {}
        self.reductions: dict[str, str] = {}

    def add_state(self, name: str, initial: float | Tensor, reduce: str = "sum") -> None:
        if reduce not in REDUCTIONS:
            raise ValueError(f"state {name!r}: reduce must be one of {', '.join(REDUCTIONS)}, got {reduce!r}")
        # float64: sums over millions of samples keep their last digits.
        value = torch.as_tensor(initial, dtype=torch.float64).clone()
        self._initial[name] = value.clone()
        self.state[name] = value
        self.reductions[name] = reduce

    @abstractmethod
    def update(self, outputs: Any, targets: Any) -> None:
        """Add one batch; runs on the training device, every call, so it must not read values back."""

    @abstractmethod
    def compute(self) -> float | Tensor:
        """The value, from the states once they hold every rank's contribution."""

    def reset(self) -> None:
        for name, initial in self._initial.items():
            self.state[name] = initial.to(self.state[name].device, copy=True)

    def to(self, device: torch.device) -> Metric:
        self.state = {name: value.to(device) for name, value in self.state.items()}
        return self


class Average(Metric):
    """A total over samples divided by their number, the shape of most metrics: subclasses say, per batch,
    what to add to each (``amounts``); the two sums are what ranks add up."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", 0.0)
        self.add_state("count", 0.0)

    @abstractmethod
    def amounts(self, outputs: Any, targets: Any) -> tuple[Tensor | float, Tensor | float]:
        """(what this batch adds to the total, how many samples or elements it counts for)."""

    def update(self, outputs: Any, targets: Any) -> None:
        total, count = self.amounts(outputs, targets)
        self.state["total"] += total
        self.state["count"] += count

    def compute(self) -> Tensor:
        return self.state["total"] / self.state["count"].clamp_min(1)


class Mean(Average):
    """The sample-weighted mean of a per-batch value (the task's loss): ``update(value, samples)``."""

    def amounts(self, value: Any, count: Any) -> tuple[Tensor, Any]:
        return value.detach().double() * count, count


class Accuracy(Average):
    """Share of samples whose highest-scoring class (the argmax of dim 1) is the target."""

    def amounts(self, outputs: Tensor, targets: Tensor) -> tuple[Tensor, int]:
        return (outputs.argmax(dim=1) == targets).sum(), targets.numel()


class MeanAbsoluteError(Average):
    """Mean of |output - target| over every element."""

    def amounts(self, outputs: Tensor, targets: Tensor) -> tuple[Tensor, int]:
        return (outputs.double() - targets.double()).abs().sum(), targets.numel()


class RootMeanSquaredError(Average):
    """Square root of the mean of (output - target)^2 over every element."""

    def amounts(self, outputs: Tensor, targets: Tensor) -> tuple[Tensor, int]:
        return (outputs.double() - targets.double()).pow(2).sum(), targets.numel()

    def compute(self) -> Tensor:
        return super().compute().sqrt()
