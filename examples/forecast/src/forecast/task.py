"""The task: what ddp-deploy trains when run with ``--task forecast:Forecast``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from forecast.data import SensorWindows, make_series
from forecast.metrics import R2Score
from forecast.model import ForecastNet
from trainer.metrics import MeanAbsoluteError
from trainer.options import ResumeRule, check, option
from trainer.task import Task, TaskContext, TaskData

REFUSE, FLAG = ResumeRule.REFUSE, ResumeRule.FLAG


@dataclass
class ForecastOptions:
    channels: int = option(3, "sensor channels per series", resume=REFUSE)
    window: int = option(32, "input steps per sample", resume=REFUSE)
    train_series: int = option(48, "generated series to train on (each gives length - window samples)",
                               resume=REFUSE)
    eval_series: int = option(12, "generated series to evaluate on", resume=REFUSE)
    length: int = option(96, "steps per series", resume=REFUSE)
    hidden: int = option(32, "GRU width", resume=REFUSE)
    dropout: float = option(0.1, "dropout before the head", resume=FLAG)
    noise: float = option(0.05, "measurement noise added to training inputs, drawn anew each epoch", resume=FLAG)
    huber_delta: float = option(1.0, "where the Huber loss turns from squared to linear", resume=FLAG)

    def __post_init__(self) -> None:
        check(self.channels >= 1, f"--channels must be >= 1, got {self.channels}")
        check(2 <= self.window < self.length, f"--window must be in 2..{self.length - 1}, got {self.window}")
        check(self.train_series >= 1 and self.eval_series >= 1, "--train-series and --eval-series must be >= 1")
        check(self.hidden >= 1, f"--hidden must be >= 1, got {self.hidden}")
        check(0 <= self.dropout < 1, f"--dropout must be in [0, 1), got {self.dropout}")
        check(self.noise >= 0 and self.huber_delta > 0, "--noise must be >= 0 and --huber-delta > 0")


class Forecast(Task[ForecastOptions]):
    """Predict the next step of every channel from the last ``window`` steps."""

    name = "forecast"
    Options = ForecastOptions
    monitor, monitor_mode = "mae", "min"

    def datasets(self, context: TaskContext) -> TaskData:
        o = self.options
        # The evaluation series come from another seed: unseen series, not held-out windows of seen ones.
        train = SensorWindows(make_series(o.train_series, o.length, o.channels, seed=1), o.window, o.noise)
        evaluation = SensorWindows(make_series(o.eval_series, o.length, o.channels, seed=2), o.window, noise=0.0)
        # In memory and cheap to slice; the noise makes items random, so the trainer seeds each one.
        return TaskData(train, evaluation, in_memory=True, deterministic_items=False)

    def model(self, data: TaskData) -> nn.Module:
        return ForecastNet(self.options.channels, self.options.hidden, self.options.dropout)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.huber_loss(outputs.float(), targets, delta=self.options.huber_delta)

    def metrics(self) -> Mapping[str, Any]:
        return {"mae": MeanAbsoluteError(), "r2": R2Score(self.options.channels)}
