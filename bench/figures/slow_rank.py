"""Figure 18: what the slow-rank detector (trainer/slow_rank.py) costs: samples/s with it on, against off.

Two ranks under torchrun on this machine (gloo, one thread each), the ConvNet on Fashion-MNIST in memory, batch
128 per rank: the same runs with --slow-rank-every 10 (the default: each step's data wait and forward timed, an
all-gather of three numbers every 10 steps) and --slow-rank-every 0, one after the other, round after round, as
figure 3 measures the trainer's overhead. A run's value is the median samples/s of its windows after the first.
How soon it names a slowed rank, and that it names no one in an even run, is docs/configuration.md's.
"""

from __future__ import annotations

from itertools import count

from bench.harness.context import Context
from bench.harness.launch import fashion_mnist_convnet_args, run_trainer
from bench.harness.measure import interleave, load_average, median, paired_ratio
from bench.harness.results import FigureResult, Goal, Row

TITLE = "Slow-rank detector overhead (2 ranks)"
GOAL = Goal(">=", 0.99)


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    steps, log_every = ctx.pick(120, 8), ctx.pick(10, 4)
    runs = count()

    def trainer(every: int) -> float:
        output = ctx.scratch(f"slow-rank-{every}-{next(runs)}")
        args = [*fashion_mnist_convnet_args(steps, log_every), "--slow-rank-every", str(every)]
        return run_trainer(args, output, 2, ctx.pick(300, 180)).steady_samples_per_s()

    values = interleave({"off": lambda: trainer(0), "on": lambda: trainer(10)}, rounds=ctx.pick(7, 1))
    ratio = paired_ratio(values["on"], values["off"])
    rows = [Row("samples/s with the slow-rank detector / without", ratio.median, GOAL, spread=ratio.spread,
                notes=f"median of {len(ratio.rounds)} round(s); {steps} steps, windows of {log_every}, the first "
                      f"left out; on {median(values['on']):,.0f}, off {median(values['off']):,.0f} samples/s "
                      f"(medians)")]
    details = {"samples_per_s": values, "steps": steps, "log_every": log_every,
               "load_average": [load_before, load_average()]}
    return FigureResult(18, "slow-rank", TITLE, rows, details)
