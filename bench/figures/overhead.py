"""Figure 3: framework overhead: the trainer at world size 1 against a minimal hand-written loop.

Both train the ConvNet on Fashion-MNIST in memory, batch 128, one thread, AdamW, in separate processes
run one after the other, round after round. Each reports samples per second over windows of steps,
the first window (start-up, cold caches) left out; a run's value is the median of its windows.
"""

from __future__ import annotations

import sys
from itertools import count

from bench.harness.context import Context
from bench.harness.launch import fashion_mnist_convnet_args, run_trainer, steady_windows
from bench.harness.measure import interleave, load_average, paired_ratio
from bench.harness.results import FigureResult, Goal, Row

TITLE = "Framework overhead (world size 1)"
GOAL = Goal(">=", 0.97)


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    steps, log_every = ctx.pick(100, 6), ctx.pick(10, 3)
    trainer_args = fashion_mnist_convnet_args(steps, log_every)
    runs = count()

    def trainer() -> float:
        output = ctx.scratch(f"overhead-trainer-{next(runs)}")
        return run_trainer(trainer_args, output, None, ctx.pick(300, 180)).steady_samples_per_s()

    def minimal() -> float:
        out = ctx.scratch("overhead-minimal") / f"windows-{next(runs)}.json"
        command = [sys.executable, "-m", "bench.workers.minimal_loop", str(steps), str(log_every), str(out)]
        return steady_windows(command, out, ctx.pick(300, 180))

    # Seven rounds: one run of either varies by ±10% on a shared machine, so three were not enough to settle.
    values = interleave({"minimal": minimal, "trainer": trainer}, rounds=ctx.pick(7, 1))
    ratio = paired_ratio(values["trainer"], values["minimal"])
    rows = [Row("trainer samples/s / minimal loop samples/s", ratio.median, GOAL, spread=ratio.spread,
                notes=f"median of {steps // log_every - 1} windows of {log_every} steps per run; trainer: the "
                      f"built-in task through the task seam, DataLoader over uint8 tensors normalised per batch, "
                      f"LR schedule, loss and accuracy summed every step (no DDP wrapper nor stop-signal collective "
                      f"at world size 1); minimal: pre-normalised floats")]
    details = {"samples_per_s": values, "steps": steps, "log_every": log_every,
               "load_average": [load_before, load_average()]}
    return FigureResult(3, "overhead", TITLE, rows, details)
