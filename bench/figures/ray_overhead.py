"""Figure 15: the trainer under Ray Train (ddp-train-ray) against the trainer under torchrun, on the same work.

Two ranks on this machine, the ConvNet on Fashion-MNIST, batch 128 per rank (figure 10's loop). Under Ray, a real
local cluster (devtools/ray_cluster.py: a head without CPUs and two worker nodes of one CPU each) runs the two
workers; under torchrun, two ranks of the same interpreter. Each run's value is the median samples/s of its
metrics windows after the first, from the trainer's own metrics.jsonl, so both sides are measured the same way;
the two alternate round by round and each ratio is taken within a round. Ray's start-up (its worker actors, the
group) is also reported, as the time from the launch to the first step against torchrun's.

Quick mode (CI) runs torchrun only, as figure 8 does for its containers: a Ray cluster's start and a driver cost a
minute on two cores.
"""

from __future__ import annotations

import json
import sys
import time
from itertools import count
from pathlib import Path

from bench.harness.context import Context
from bench.harness.launch import (
    TRAINER_QUIET,
    TrainerRun,
    fashion_mnist_convnet_args,
    first_step_time,
    read_metrics,
    run_trainer,
)
from bench.harness.launch import run as run_command
from bench.harness.measure import interleave, load_average, median, paired_ratio
from bench.harness.results import FigureResult, Goal, Row
from devtools.ray_cluster import RayCluster

TITLE = "Under Ray Train (2 workers) against torchrun (2 ranks)"
# Ray's CPU release test allowed its trainer 1.15x the time of plain PyTorch: samples/s at least 1/1.15 of torchrun's.
GOAL = Goal(">=", round(1 / 1.15, 2))
TIMEOUT_S = 600


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    steps, log_every = ctx.pick(120, 8), ctx.pick(10, 4)
    trainer_args = fashion_mnist_convnet_args(steps, log_every)
    runs = count()
    first_steps: dict[str, list[float]] = {"torchrun": [], "ray": []}

    def torchrun() -> float:
        result = run_trainer(trainer_args, ctx.scratch(f"ray-torchrun-{next(runs)}"), 2, TIMEOUT_S)
        first_steps["torchrun"].append(first_step_time(result.records) - result.launched_at)
        return result.steady_samples_per_s()

    if ctx.quick:
        torchrun()
        row = Row("trainer under Ray samples/s / under torchrun", None, GOAL,
                  notes="not measured (quick mode runs torchrun only)")
        return FigureResult(15, "ray", TITLE, [row], {"quick": True})

    with RayCluster() as cluster:
        cluster.add_node("a")
        cluster.add_node("b")

        def on_ray() -> float:
            result = _ray_run(trainer_args, ctx.scratch(f"ray-{next(runs)}"), cluster)
            first_steps["ray"].append(first_step_time(result.records) - result.launched_at)
            return result.steady_samples_per_s()

        values = interleave({"ray": on_ray, "torchrun": torchrun}, rounds=5)
    ratio = paired_ratio(values["ray"], values["torchrun"])
    start = paired_ratio(first_steps["ray"], first_steps["torchrun"])
    rows = [
        Row("trainer under Ray samples/s / under torchrun", ratio.median, GOAL, spread=ratio.spread,
            notes=f"median of {len(ratio.rounds)} rounds; {steps} steps, windows of {log_every}, the first left out; "
                  f"Ray {median(values['ray']):,.0f}, torchrun {median(values['torchrun']):,.0f} samples/s"),
        Row("launch to first step, Ray / torchrun", start.median, spread=start.spread,
            notes=f"Ray {median(first_steps['ray']):.1f} s (the driver, its controller, two worker actors, the "
                  f"trainer's group), torchrun {median(first_steps['torchrun']):.1f} s"),
    ]
    details = {"samples_per_s": values, "first_step_s": first_steps, "steps": steps, "log_every": log_every,
               "python": sys.version.split()[0], "load_average": [load_before, load_average()]}
    return FigureResult(15, "ray", TITLE, rows, details)


def _ray_run(args: list[str], scratch: Path, cluster: RayCluster) -> TrainerRun:
    """ddp-train-ray with two workers; its metrics, in the Ray run's folder."""
    storage, name = scratch / "ray", "bench"
    launched_at = time.time()
    run_command([sys.executable, "-m", "trainer.on_ray", "--ray-workers", "2", "--ray-storage-path", str(storage),
                 "--ray-run-name", name, *TRAINER_QUIET, *args], TIMEOUT_S, env=cluster.env())
    output = storage / name
    summary = output / "summary.json"
    return TrainerRun(launched_at, read_metrics(output / "metrics.jsonl"),
                      json.loads(summary.read_text()) if summary.is_file() else {})
