"""Figure 6: the trainer's SyncBatchNorm on gloo against plain BatchNorm, 2 ranks under the trainer's DDP.

``--sync-bn`` on CPU converts the ConvNet's two BatchNorm layers to trainer.syncbn.GlooSyncBatchNorm:
each adds one small all-reduce to forward and one to backward, and computes its statistics in
separate (unfused) operations.
"""

from __future__ import annotations

from bench.harness.context import Context
from bench.harness.measure import load_average, paired_ratio
from bench.harness.phases import Phase, Plan, measure
from bench.harness.results import FigureResult, Row

TITLE = "SyncBatchNorm on gloo (2 ranks)"


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    plain, synced = Phase("batchnorm", method="ddp"), Phase("sync-batchnorm", method="ddp", sync_bn=True)
    plan = Plan([plain, synced], rounds=ctx.pick(4, 1), steps=ctx.pick(8, 2))
    times = measure(plan, ctx.scratch("syncbn-phases"), timeout_s=ctx.pick(600, 240))
    ratio = paired_ratio(times.step_time(synced.name), times.step_time(plain.name))
    parts = {phase.name: times.parts(phase.name) for phase in (plain, synced)}
    cpu = paired_ratio(times.cpu_per_sample(synced.name), times.cpu_per_sample(plain.name))
    extra_ms = {part: (parts[synced.name][part] - parts[plain.name][part]) * 1e3 for part in ("forward", "backward")}
    row = Row("step time `--sync-bn` / plain BatchNorm", ratio.median, spread=ratio.spread,
              notes=f"4 more blocking all-reduces per step (2 layers × forward and backward) and unfused "
                    f"normalisation: CPU per sample ×{cpu.median:.2f}; forward {extra_ms['forward']:+.1f} ms, "
                    f"backward {extra_ms['backward']:+.1f} ms per step; sync-bn: {times.describe(synced.name)}; "
                    f"plain: {times.describe(plain.name)}")
    details = {"step_s": {phase.name: times.step_time(phase.name) for phase in (plain, synced)},
               "step_parts_s": parts, "plan": {"rounds": plan.rounds, "steps": plan.steps},
               "load_average": [load_before, load_average()]}
    return FigureResult(6, "syncbn", TITLE, [row], details)
