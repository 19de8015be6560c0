"""Evaluation metrics as reductions across ranks, so that a metric is exact at any world size.

A ``Metric`` keeps running sums (or maxima, minima) as tensors; after every rank has seen its shard,
the trainer reduces each state across ranks once and calls ``compute()``. Because evaluation gives
each sample to exactly one rank, the reduced sums are those of one process that saw every sample.

A ``torchmetrics.Metric`` works as a task metric too: torchmetrics declares a reduction for each of
its states (``dist_reduce_fx``) and synchronises them itself when ``compute()`` is called.

Writing one::

    class MeanAbsoluteError(Metric):
        def __init__(self) -> None:
            super().__init__()
            self.add_state("error", 0.0)
            self.add_state("count", 0.0)

        def update(self, outputs, targets):
            self.state["error"] += (outputs.float() - targets).abs().sum()
            self.state["count"] += targets.numel()

        def compute(self):
            return self.state["error"] / self.state["count"]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

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


class Mean(Metric):
    """The sample-weighted mean of a per-batch value (the task's loss, for instance)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", 0.0)
        self.add_state("count", 0.0)

    def update(self, value: Any, count: Any) -> None:
        self.state["total"] += value.detach().double() * count
        self.state["count"] += count

    def compute(self) -> Tensor:
        return self.state["total"] / self.state["count"].clamp_min(1)


class Accuracy(Metric):
    """Share of samples whose highest-scoring class (the argmax of dim 1) is the target."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("correct", 0.0)
        self.add_state("count", 0.0)

    def update(self, outputs: Tensor, targets: Tensor) -> None:
        self.state["correct"] += (outputs.argmax(dim=1) == targets).sum()
        self.state["count"] += targets.numel()

    def compute(self) -> Tensor:
        return self.state["correct"] / self.state["count"].clamp_min(1)


class MeanAbsoluteError(Metric):
    """Mean of |output - target| over every element."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("error", 0.0)
        self.add_state("count", 0.0)

    def update(self, outputs: Tensor, targets: Tensor) -> None:
        self.state["error"] += (outputs.double() - targets.double()).abs().sum()
        self.state["count"] += targets.numel()

    def compute(self) -> Tensor:
        return self.state["error"] / self.state["count"].clamp_min(1)


class RootMeanSquaredError(Metric):
    """Square root of the mean of (output - target)^2 over every element."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("squared_error", 0.0)
        self.add_state("count", 0.0)

    def update(self, outputs: Tensor, targets: Tensor) -> None:
        self.state["squared_error"] += (outputs.double() - targets.double()).pow(2).sum()
        self.state["count"] += targets.numel()

    def compute(self) -> Tensor:
        return (self.state["squared_error"] / self.state["count"].clamp_min(1)).sqrt()
