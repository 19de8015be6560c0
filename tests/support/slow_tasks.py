"""The built-in task with one rank made slow on purpose, phase by phase: what trainer.slow_rank must name.

``--phases none:200,compute:60,data:60``: for the first 200 training batches no rank is slowed, then for 60 the
forward pass of ``--slowed-rank`` does ``1 + --slow-by`` times the work (CPU time spun, as a slower device would
take: the trainer times compute on the CPU in CPU time), then for 60 its batches take that much longer to load (a
sleep: waiting, as for a slow disk). Every rank may be given a fixed cost per batch in each part first
(``--load-ms`` asleep, ``--forward-ms`` of CPU time), so that a slowdown is a known share of the step whatever the
machine's speed. Used as ``--task tests.support.slow_tasks:SlowRankTask``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from trainer.options import option
from trainer.task import TaskContext, TaskData
from trainer.tasks.classification import ClassificationOptions, ImageClassification


@dataclass
class SlowRankOptions(ClassificationOptions):
    slowed_rank: int = option(1, "the rank that is slowed in the phases that say so")
    phases: str = option("", "PART:BATCHES,...: what is slowed on that rank (none, compute or data), phase by phase, "
                             "counted in training batches")
    slow_by: float = option(0.5, "how much longer the slowed part takes: 0.5 makes it 1.5 times as long")
    load_ms: float = option(0.0, "every rank's time to load each batch (a sleep in the collate function)")
    forward_ms: float = option(0.0, "every rank's extra CPU time in each forward pass (spun)")

    def slowed(self, part: str, batch: int) -> bool:
        """Whether ``part`` is slowed at training batch ``batch`` (0-based) on the slowed rank."""
        for phase in filter(None, self.phases.split(",")):
            name, _, batches = phase.partition(":")
            if batch < int(batches):
                return name == part
            batch -= int(batches)
        return False


def spin(cpu_s: float) -> None:
    """Work for ``cpu_s`` seconds of this process's CPU time."""
    until = time.process_time() + cpu_s
    while time.process_time() < until:
        pass


class Phased:
    """Counts the training batches that pass through it (a forward pass with gradients, a collated batch), and
    makes each cost ``fixed_s`` more, and the slowed ones ``--slow-by`` times more again: in ``clock``'s time,
    spent by ``spend``."""

    def __init__(self, options: SlowRankOptions, part: str, slowed_here: bool, clock: Callable[[], float],
                 spend: Callable[[float], None]) -> None:
        self.options, self.part, self.slowed_here = options, part, slowed_here
        self.clock, self.spend = clock, spend
        self.batches = 0

    def stretch(self, run: Callable[[], Any], fixed_s: float) -> Any:
        started = self.clock()
        result = run()
        if fixed_s:
            self.spend(fixed_s)
        if self.slowed_here and self.options.slowed(self.part, self.batches):
            self.spend(self.options.slow_by * (self.clock() - started))
        self.batches += 1
        return result


class SlowLoading(Phased):
    def __init__(self, collate: Callable[[Any], Any], options: SlowRankOptions, slowed_here: bool) -> None:
        super().__init__(options, "data", slowed_here, time.perf_counter, time.sleep)
        self.collate = collate

    def __call__(self, items: Any) -> Any:
        return self.stretch(lambda: self.collate(items), self.options.load_ms / 1e3)


class SlowForward(nn.Module):
    def __init__(self, model: nn.Module, options: SlowRankOptions, slowed_here: bool) -> None:
        super().__init__()
        self.model = model
        self.phased = Phased(options, "compute", slowed_here, time.process_time, spin)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # the first-batch check, evaluation: not a training batch
            return self.model(inputs)
        return self.phased.stretch(lambda: self.model(inputs), self.phased.options.forward_ms / 1e3)


class SlowRankTask(ImageClassification):
    name = "slow-rank"
    Options = SlowRankOptions
    options: SlowRankOptions

    def datasets(self, context: TaskContext) -> TaskData:
        self.slowed_here = context.runtime.identity.rank == self.options.slowed_rank
        data = super().datasets(context)
        loading = SlowLoading(data.collate_fn or default_collate, self.options, self.slowed_here)
        return dataclasses.replace(data, collate_fn=loading)

    def model(self, data: TaskData) -> nn.Module:
        return SlowForward(super().model(data), self.options, self.slowed_here)
