"""--profile-steps A-B: a torch.profiler trace of optimizer steps A to B on every rank, and on CUDA a memory
snapshot of the same steps; --memory-snapshot-on-oom: on CUDA, the allocator's history when a rank runs out of
memory.

Each rank writes ``OUTPUT_DIR/profiles/rank-R.pt.trace.json`` (Chrome trace format: Perfetto opens it, and
TensorBoard's profiler plugin reads the folder) and, on CUDA, ``rank-R.memory.pickle`` (the allocator's
history: https://pytorch.org/memory_viz). Each profiled step is a range named ``ProfilerStep#N`` in the trace,
N the run's optimizer step (resumed runs go on counting). Profiling starts before step A's first micro-batch
and stops after step B's optimizer update, or at the end of training if that comes first.

With --memory-snapshot-on-oom the allocator records from the start (every allocation's stack: a little slower), and
an out-of-memory error anywhere in training writes ``rank-R.oom.memory.pickle`` before the error ends the run:
what held the memory, and where it was allocated. CPU runs have no such history; the flag warns and does nothing.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["StepProfiler", "out_of_memory_message"]

HISTORY_ENTRIES = 100_000  # the allocator's last allocations and frees kept: enough for a few steps of a large model


class StepProfiler:
    def __init__(self, steps: tuple[int, int] | None, output_dir: Path, rank: int, device: torch.device,
                 log: logging.Logger, snapshot_on_oom: bool = False) -> None:
        self.steps = steps
        self.folder = output_dir / "profiles"
        self.rank = rank
        self.device = device
        self.log = log
        self._profile: profile | None = None
        self._step_range = ExitStack()
        self._done = False
        self.snapshot_on_oom = snapshot_on_oom and device.type == "cuda"
        if snapshot_on_oom and not self.snapshot_on_oom:
            log.warning("--memory-snapshot-on-oom records CUDA's allocator; this run is on %s, so it records nothing",
                        device.type)
        if self.snapshot_on_oom:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)

    def out_of_memory(self) -> Path | None:
        """After an out-of-memory error: the allocator's history written (with --memory-snapshot-on-oom), or None."""
        if not self.snapshot_on_oom:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        snapshot = self.folder / f"rank-{self.rank}.oom.memory.pickle"
        torch.cuda.memory._dump_snapshot(str(snapshot))
        self.log.error("out of memory: wrote the allocator's history to %s (open it at https://pytorch.org/memory_viz)",
                       snapshot)
        return snapshot

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
            if not self.snapshot_on_oom:  # otherwise it goes on recording, for an out-of-memory error later
                torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snapshot)
        self.log.info("--profile-steps %s: wrote %s", "-".join(map(str, self.steps or ())),
                      ", ".join(map(str, written)))

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
        self._profile = profile(activities=activities, record_shapes=True, profile_memory=True)
        self._profile.start()


def out_of_memory_message(error: BaseException, step: int, snapshot: Path | None, global_batch: bool = False) -> str:
    """One line for a rank that ran out of memory: where, what it tried, and what to change. ``global_batch``:
    --global-batch-size sets the micro-batch, so more accumulation steps make it smaller."""
    tried = str(error).partition("\n")[0].strip().rstrip(".")
    where = f"at optimizer step {step + 1}"
    hint = (f"the allocator's history is in {snapshot}" if snapshot is not None
            else "--memory-snapshot-on-oom records what held the memory")
    smaller = ("raise --grad-accum-steps (each micro-batch shrinks, the step stays --global-batch-size)"
               if global_batch else "lower --batch-size (with --grad-accum-steps to keep the effective batch)")
    return (f"out of memory {where} ({tried}); {smaller}, use --precision bf16, or shard the model with --sync "
            f"fsdp; {hint}")
