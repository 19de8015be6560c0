"""--profile-steps A-B: a torch.profiler trace of optimizer steps A to B on every rank, and on CUDA a memory
snapshot of the same steps.

Each rank writes ``OUTPUT_DIR/profiles/rank-R.pt.trace.json`` (Chrome trace format: Perfetto opens it, and
TensorBoard's profiler plugin reads the folder) and, on CUDA, ``rank-R.memory.pickle`` (the allocator's
history: https://pytorch.org/memory_viz). Each profiled step is a range named ``ProfilerStep#N`` in the trace,
N the run's optimizer step (resumed runs go on counting). Profiling starts before step A's first micro-batch
and stops after step B's optimizer update, or at the end of training if that comes first.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["StepProfiler"]


class StepProfiler:
    def __init__(self, steps: tuple[int, int] | None, output_dir: Path, rank: int, device: torch.device,
                 log: logging.Logger) -> None:
        self.steps = steps
        self.folder = output_dir / "profiles"
        self.rank = rank
        self.device = device
        self.log = log
        self._profile: profile | None = None
        self._step_range = ExitStack()
        self._done = False

    def before_step(self, step: int) -> None:
        """Before the first micro-batch of optimizer step ``step`` (1-based)."""
        if self.steps is None or self._done or not self.steps[0] <= step <= self.steps[1]:
            return
        if self._profile is None:
            self._start()
        self._step_range.enter_context(record_function(f"ProfilerStep#{step}"))

    def after_step(self, step: int) -> None:
        """After optimizer step ``step``'s update."""
        if self._profile is None:
            return
        self._step_range.close()
        if self.steps is not None and step >= self.steps[1]:
            self.finish()

    def finish(self) -> None:
        """Stop and write what was recorded (at step B, or at the end of training if that came first)."""
        if self._profile is None:
            return
        self._step_range.close()
        profiled, self._profile = self._profile, None
        self._done = True
        profiled.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank-{self.rank}.pt.trace.json"
        profiled.export_chrome_trace(str(trace))
        written = [trace]
        if self.device.type == "cuda":
            snapshot = self.folder / f"rank-{self.rank}.memory.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snapshot)
        self.log.info("--profile-steps %s: wrote %s", "-".join(map(str, self.steps or ())),
                      ", ".join(map(str, written)))

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._profile = profile(activities=activities, record_shapes=True, profile_memory=True)
        self._profile.start()
