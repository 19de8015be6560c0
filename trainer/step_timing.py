"""How long this rank's optimizer steps wait for data and compute, summed over a window of steps.

Each part is free of the gradient sync's waits, so that the ranks' times can be compared (trainer.slow_rank):

- data: the time blocked in the loader's next(), plus the batch's copy to the device and the task's
  preparation there (``TaskData.on_device``);
- compute: the forward pass and the loss. Under DDP every fast rank waits for the slowest in the backward
  pass's all-reduce, so a step's time is everyone's alike; the forward holds none of the gradient sync, so its
  time is this rank's own work. DDP does broadcast the module's buffers (BatchNorm's statistics) before the
  forward, a wait for the others too (for a rank slow to load its batch): the clock starts in a hook of the
  module inside DDP, after that broadcast.

Where the forward itself holds collectives (FSDP's all-gathers of parameters, SyncBatchNorm's all-reduces), a
fast rank's forward waits for the slow rank, and on a GPU that wait is in its time: ``time_compute`` False, and
only data is timed (on the CPU too, so that one rule holds on both).

Compute is the device's time. On CUDA, events on the current stream, read once per window (one wait for the
window's last forward to end on the device, never a synchronisation per step), not the host's time spent queueing
kernels ahead of it. On the CPU, the CPU time the process spent (time.process_time: its intra-op threads too),
not the wall time, which holds the time the rank waited for a core: with 2 ranks on 2 cores shared with other
work, the ranks' forward times over 10-step windows of an even run differed 0.56x to 1.75x in wall time, 0.82x
to 1.08x in CPU time. Data is wall time either way: what the loop waits for (a disk, the network, workers), it
waits for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainer.gradsync import unwrap

T = TypeVar("T")


@dataclass(frozen=True)
class StepParts:
    """One rank's times over a window of optimizer steps, in seconds."""

    data_s: float
    compute_s: float
    # The steps' wall time on the host, from asking for the first batch to the optimizer's update: evaluations,
    # saves and log lines between steps are left out.
    step_s: float
    steps: int


class _HostClock:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.total_s = 0.0
        self._started: float | None = None

    def start(self) -> None:
        self._started = self.clock()

    def stop(self) -> None:
        if self._started is not None:
            self.total_s += self.clock() - self._started
            self._started = None

    def read(self) -> float:
        total, self.total_s = self.total_s, 0.0
        return total


class _DeviceClock:
    """CUDA events around each timed region; the window's pairs are read (and the events reused) at its end."""

    def __init__(self) -> None:
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._spare: list[torch.cuda.Event] = []
        self._started: torch.cuda.Event | None = None

    def _event(self) -> torch.cuda.Event:
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self._started is None:
            self._started = self._event()
        self._started.record()  # recorded again where a region was started and never stopped

    def stop(self) -> None:
        if self._started is not None:
            stopped = self._event()
            stopped.record()
            self._pairs.append((self._started, stopped))
            self._started = None

    def read(self) -> float:
        if not self._pairs:
            return 0.0
        self._pairs[-1][1].synchronize()  # the stream's order: every earlier event of the window is done too
        total_ms = sum(started.elapsed_time(stopped) for started, stopped in self._pairs)
        for pair in self._pairs:
            self._spare.extend(pair)
        self._pairs.clear()
        return total_ms / 1e3


_NOT_TIMED = nullcontext()


class StepTiming:
    """The loop's marks, a window's totals. ``enabled`` False: every mark does nothing (no hook, no clock)."""

    def __init__(self, model: nn.Module, device: torch.device, enabled: bool, time_compute: bool) -> None:
        self.enabled = enabled
        self.time_compute = enabled and time_compute
        on_cuda = device.type == "cuda"
        self._copy: _HostClock | _DeviceClock = _DeviceClock() if on_cuda else _HostClock(time.perf_counter)
        self._compute: _HostClock | _DeviceClock = _DeviceClock() if on_cuda else _HostClock(time.process_time)
        self._waited_s = 0.0
        self._step_s = 0.0
        self._steps = 0
        self._step_started: float | None = None
        self._hook: RemovableHandle | None = None
        if self.time_compute:
            # On the module inside DDP and torch.compile: its forward starts after DDP's buffer broadcast.
            # Run eagerly under torch.compile, where a clock read would otherwise be traced into the graph.
            self._hook = unwrap(model).register_forward_pre_hook(torch.compiler.disable(self._forward_starts))

    def _forward_starts(self, module: nn.Module, inputs: Any) -> None:
        if torch.is_grad_enabled():  # a training forward (evaluation's run under no_grad)
            self._compute.start()

    def batches(self, loader: Iterable[T]) -> Iterable[T]:
        """The loader's batches, the time blocked waiting for each counted as data."""
        return self._timed(loader) if self.enabled else loader

    def _timed(self, loader: Iterable[T]) -> Iterator[T]:
        batches = iter(loader)
        while True:
            asked = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._waited_s += time.perf_counter() - asked
            if self._step_started is None:
                self._step_started = asked
            yield batch

    def copying(self) -> AbstractContextManager[None]:
        """Around the batch's move to the device: counted as data."""
        return self._copied() if self.enabled else _NOT_TIMED

    @contextmanager
    def _copied(self) -> Iterator[None]:
        self._copy.start()
        yield
        self._copy.stop()

    def computed(self) -> None:
        """Right after the loss: the end of the compute timed since the forward began."""
        if self.time_compute:
            self._compute.stop()

    def step_done(self) -> None:
        """After the optimizer's update."""
        if self._step_started is not None:
            self._step_s += time.perf_counter() - self._step_started
            self._step_started = None
            self._steps += 1

    def window(self) -> StepParts:
        """The totals since the last call, and a fresh window."""
        parts = StepParts(self._waited_s + self._copy.read(), self._compute.read(), self._step_s, self._steps)
        self._waited_s = self._step_s = 0.0
        self._steps = 0
        return parts

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
