"""Figure 2: the trainer's gradient-sync methods, 2 ranks: the tutorials' against DDP.

The phases use the trainer's own GradSync classes (trainer.gradsync), so what is timed is what
``--sync`` selects. The ConvNet has 10 parameter tensors (116 KB of gradients): ``allreduce`` sends
10 all-reduces after backward, ``reduce-broadcast`` 10 reduces and 10 broadcasts, DDP one bucket.
"""

from __future__ import annotations

from bench.harness.context import Context
from bench.harness.measure import load_average, paired_ratio
from bench.harness.phases import Phase, Plan, measure
from bench.harness.results import FigureResult, Row

TITLE = "Synchronisation methods (2 ranks)"
METHODS = ("ddp", "allreduce", "reduce-broadcast")


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    plan = Plan([Phase(method, method=method) for method in METHODS], rounds=ctx.pick(4, 1), steps=ctx.pick(8, 2))
    times = measure(plan, ctx.scratch("sync-phases"), timeout_s=ctx.pick(600, 240))
    ddp = times.step_time("ddp")
    parts = {method: times.parts(method) for method in METHODS}
    rows = []
    for method, messages in (("allreduce", 10), ("reduce-broadcast", 20)):
        ratio = paired_ratio(times.step_time(method), ddp)
        cpu = paired_ratio(times.cpu_per_sample(method), times.cpu_per_sample("ddp"))
        rows.append(Row(f"step time `--sync {method}` / `--sync ddp`", ratio.median, spread=ratio.spread,
                        notes=f"{messages} blocking collectives after backward instead of one 116 KB bucket in it; "
                              f"{method}: {times.describe(method)}; ddp: {times.describe('ddp')}; "
                              f"CPU per sample ×{cpu.median:.2f}"))
    details = {"step_s": {method: times.step_time(method) for method in METHODS}, "step_parts_s": parts,
               "plan": {"rounds": plan.rounds, "steps": plan.steps}, "load_average": [load_before, load_average()]}
    return FigureResult(2, "sync", TITLE, rows, details)
