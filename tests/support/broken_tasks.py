"""Tasks broken in every way a user's task can be, for the bad-input tests (tests/unit/test_task_errors.py).

Each is a small working task (TinyTask) with one thing wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from trainer.metrics import MeanAbsoluteError, Metric
from trainer.options import option
from trainer.task import Task, TaskContext, TaskData


class Pairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Inputs of 4 features, a target of 1: index-derived, so the same everywhere."""

    def __init__(self, size: int = 32, odd_one: int | None = None, odd_item: Any = None) -> None:
        self.size = size
        self.odd_one = odd_one
        self.odd_item = odd_item

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        if index == self.odd_one:
            return self.odd_item
        x = torch.arange(4, dtype=torch.float32) + index
        return x, x.sum(dim=0, keepdim=True)


@dataclass
class TinyOptions:
    width: int = option(4, "input features the model takes")


class TinyTask(Task[TinyOptions]):
    name = "tiny"
    Options = TinyOptions

    def datasets(self, context: TaskContext) -> TaskData:
        return TaskData(Pairs(), Pairs(16))

    def model(self, data: TaskData) -> nn.Module:
        return nn.Linear(self.options.width, 1)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)


class LacksLoss(TinyTask):
    loss = Task.loss  # as if never written


class NoName(TinyTask):
    name = ""


class OptionsNotADataclass(TinyTask):
    Options = dict  # type: ignore[assignment]


class OptionWithoutDefault(TinyTask):
    @dataclass
    class Options:  # type: ignore[no-redef]
        width: int


class DatasetsRaise(TinyTask):
    def datasets(self, context: TaskContext) -> TaskData:
        raise FileNotFoundError("/data/sensors.csv")


class DatasetsReturnAList(TinyTask):
    def datasets(self, context: TaskContext) -> TaskData:
        return [Pairs(), Pairs()]  # type: ignore[return-value]


class IterableData(TinyTask):
    def datasets(self, context: TaskContext) -> TaskData:
        class Stream(IterableDataset[Any]):
            def __iter__(self) -> Any:
                return iter([])
        return TaskData(Stream(), Pairs())


class ModelRaises(TinyTask):
    def model(self, data: TaskData) -> nn.Module:
        raise ValueError("hidden size must be even, got 7")


class ModelIsNotAModule(TinyTask):
    def model(self, data: TaskData) -> nn.Module:
        return lambda x: x  # type: ignore[return-value]


class ItemOfTheWrongShape(TinyTask):
    def datasets(self, context: TaskContext) -> TaskData:
        return TaskData(Pairs(odd_one=5, odd_item=(torch.zeros(3), torch.zeros(1))), Pairs(16))


class ItemOfTheWrongType(TinyTask):
    def datasets(self, context: TaskContext) -> TaskData:
        return TaskData(Pairs(odd_one=2, odd_item="a row of the CSV file"), Pairs(16))


class EvalItemOfTheWrongShape(TinyTask):
    def datasets(self, context: TaskContext) -> TaskData:
        return TaskData(Pairs(), Pairs(16, odd_one=3, odd_item=(torch.zeros(4, 2), torch.zeros(1))))


class ModelDoesNotFitTheData(TinyTask):
    def model(self, data: TaskData) -> nn.Module:
        return nn.Linear(6, 1)


class LossIsNotOneNumber(TinyTask):
    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (outputs - targets).pow(2)


class PlainObjectMetric(TinyTask):
    def metrics(self) -> Mapping[str, Any]:
        class Collector:
            def update(self, outputs: Any, targets: Any) -> None: ...
            def compute(self) -> float:
                return 0.0
        return {"rmse": Collector()}


class Counting(Metric):
    """Keeps what it saw in a list, which no rank could add to another's."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def update(self, outputs: Any, targets: Any) -> None:
        self.seen.append(1.0)

    def compute(self) -> float:
        return float(len(self.seen))


class PerFeature(MeanAbsoluteError):
    """Four numbers where one is due."""

    def compute(self) -> torch.Tensor:
        return super().compute().repeat(4)


class MetricWithoutState(TinyTask):
    def metrics(self) -> Mapping[str, Any]:
        return {"count": Counting()}


class MetricOfManyNumbers(TinyTask):
    def metrics(self) -> Mapping[str, Any]:
        return {"per_feature": PerFeature()}


class MonitorsAMissingMetric(TinyTask):
    monitor = "f1"
