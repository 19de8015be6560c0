"""Figure 1: scaling efficiency on CPU, and where the rest goes.

Efficiency = throughput of 2 ranks / (2 × throughput of 1 process), one thread per process, the
tutorial ConvNet at batch 128 per rank. Measured twice:

* the trainer itself (1 process, then 2 ranks under torchrun, round after round), the headline, and in the
  same rounds the shortest DDP loop measured exactly alike (its own processes, the same launcher, steps and
  windows): the trainer's own cost is the difference between these two;
* a bare loop in phases (bench.workers.phases), where each candidate improvement gets a phase of its own,
  next to two references: rank 0 alone, and two processes that never communicate (what two cores
  give two processes at all: shared caches and memory bandwidth, and others' jobs).

Every phase row also says where rank 0's step went: running, waiting for a core that another process
had (the kernel's run-queue time), or blocked (waiting in gloo for the other rank); and its CPU-time
efficiency, 1-process CPU per sample / CPU per sample here, which waiting of either kind cannot lower.
"""

from __future__ import annotations

import sys
from itertools import count

from bench.harness.context import Context
from bench.harness.launch import fashion_mnist_convnet_args, run_trainer, steady_windows
from bench.harness.measure import interleave, load_average, median, paired_ratio
from bench.harness.phases import Phase, PhaseTimes, Plan, measure
from bench.harness.results import FigureResult, Goal, Row
from devtools.processes import torchrun_command

GOAL = Goal(">=", 0.90)
TITLE = "Scaling efficiency on CPU"

# (phase, row label); each DDP variant changes one thing from torch's defaults.
VARIANTS = [
    (Phase("ddp"), "bare DDP, torch defaults (25 MB buckets: 1 bucket)"),
    (Phase("ddp-bucket-view", grad_as_bucket_view=True), "+ gradient_as_bucket_view (the trainer's setting)"),
    (Phase("ddp-3-buckets", bucket_mb=0.025), "bucket_cap_mb 0.025 (3 buckets, overlap with backward)"),
    (Phase("ddp-bf16-hook", hook="bf16"), "bf16 compression hook"),
    (Phase("ddp-pinned", pin=True), "every thread of rank r pinned to core r"),
    (Phase("ddp-accum-2", accum=2), "2 micro-batches per sync (no_sync), vs 1 process with 2 too"),
    (Phase("ddp-stop-check", stop_check=True), "+ the trainer's stop vote per step (an asynchronous all-reduce)"),
]
# Batch 8: a step that is mostly fixed cost (Python, dispatch, DDP's hooks, gloo's latency), not arithmetic.
TINY_SINGLE = Phase("single-batch-8", ranks=1, method="none", batch_size=8)
TINY_DDP = Phase("ddp-batch-8", batch_size=8)
SINGLE = Phase("single", ranks=1, method="none")
SINGLE_ACCUM = Phase("single-accum-2", ranks=1, method="none", accum=2)
INDEPENDENT = Phase("independent", method="none")


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    trainer_rows, trainer_details = _trainer_efficiency(ctx)
    variants = VARIANTS if not ctx.quick else VARIANTS[:1]
    phases = [SINGLE, INDEPENDENT, *(phase for phase, _ in variants)]
    if any(phase.accum > 1 for phase, _ in variants):
        phases.append(SINGLE_ACCUM)
    phases += [TINY_SINGLE, TINY_DDP]
    plan = Plan(phases, rounds=ctx.pick(5, 1), steps=ctx.pick(6, 2))
    times = measure(plan, ctx.scratch("scaling-phases"), timeout_s=ctx.pick(600, 240))

    rows = list(trainer_rows)
    efficiency, cpu_efficiency = {}, {}
    for phase, label in [*variants, (INDEPENDENT, "2 processes that never communicate (the ceiling)")]:
        reference = SINGLE_ACCUM if phase.accum > 1 else SINGLE
        ratio = paired_ratio(times.throughput(phase.name), [2 * value for value in times.throughput(reference.name)])
        cpu = paired_ratio(times.cpu_per_sample(reference.name), times.cpu_per_sample(phase.name))
        efficiency[phase.name], cpu_efficiency[phase.name] = ratio.median, cpu.median
        rows.append(Row(label, ratio.median, None if phase is INDEPENDENT else GOAL, spread=ratio.spread,
                        notes=_where_time_went(times, phase.name, cpu.median)))
    tiny = paired_ratio(times.step_time(TINY_DDP.name), times.step_time(TINY_SINGLE.name))
    tiny_ms = {phase.name: times.parts(phase.name)["wall"] * 1e3 for phase in (TINY_SINGLE, TINY_DDP)}
    rows.append(Row("fixed cost per step: step time at batch 8, bare DDP / 1 process", tiny.median, spread=tiny.spread,
                    notes=f"{tiny_ms[TINY_DDP.name]:.1f} vs {tiny_ms[TINY_SINGLE.name]:.1f} ms: DDP's hooks, gloo's "
                          f"latency, the Python around them and any wait for a core or the other rank; DDP "
                          f"{times.describe(TINY_DDP.name)}"))
    rows[0].notes = (f"2 processes that never communicate reach {efficiency[INDEPENDENT.name]:.2f} in the same run; "
                     f"1 process alone: {_where_time_went(times, SINGLE.name, 1.0)}")
    parts = {name: times.parts(name) for name in (SINGLE.name, INDEPENDENT.name, *(p.name for p, _ in variants))}
    details = {**trainer_details, "phase_efficiency": efficiency, "phase_cpu_efficiency": cpu_efficiency,
               "step_parts_s": parts,
               "buckets_bytes": {r["phase"]: r["bucket_bytes"] for r in times.records if r["rank"] == 0},
               "plan": {"rounds": plan.rounds, "steps": plan.steps, "batch_size": plan.batch_size},
               "load_average": [load_before, load_average()]}
    return FigureResult(1, "scaling", TITLE, rows, details)


def _trainer_efficiency(ctx: Context) -> tuple[list[Row], dict[str, object]]:
    """The trainer's scaling, and in the same rounds the bare DDP loop's measured alike: its own processes
    under the same launcher, the same data, steps and metrics windows (bench/workers/minimal_loop.py)."""
    steps, log_every = ctx.pick(60, 6), ctx.pick(10, 3)
    args = fashion_mnist_convnet_args(steps, log_every)
    runs = count()
    timeout = ctx.pick(300, 180)

    def trainer(nproc: int | None) -> float:
        output = ctx.scratch(f"scaling-trainer-{next(runs)}")
        return run_trainer(args, output, nproc, timeout_s=timeout).steady_samples_per_s()

    def bare(nproc: int) -> float:
        out = ctx.scratch("scaling-bare") / f"windows-{next(runs)}.json"
        loop = [str(steps), str(log_every), str(out)]
        return steady_windows(torchrun_command(nproc, "bench.workers.minimal_loop", loop) if nproc > 1
                              else [sys.executable, "-m", "bench.workers.minimal_loop", *loop], out, timeout)

    values = interleave({"one": lambda: trainer(None), "two": lambda: trainer(2), "bare_one": lambda: bare(1),
                         "bare_two": lambda: bare(2)}, rounds=ctx.pick(7, 1))
    ratio = paired_ratio(values["two"], [2 * value for value in values["one"]])
    bare_ratio = paired_ratio(values["bare_two"], [2 * value for value in values["bare_one"]])
    same_work = paired_ratio(values["two"], values["bare_two"])
    rows = [Row("the trainer: 2 ranks (torchrun) / (2 × 1 process)", ratio.median, GOAL, spread=ratio.spread),
            Row("bare DDP loop measured alike: 2 ranks (torchrun) / (2 × 1 process)", bare_ratio.median, GOAL,
                spread=bare_ratio.spread,
                notes=f"the shortest loop (DDP, fused AdamW, data in memory), its own processes, the same steps and "
                      f"windows as the trainer's; samples/s medians: trainer {median(values['two']):,.0f} and "
                      f"{median(values['one']):,.0f}, bare loop {median(values['bare_two']):,.0f} and "
                      f"{median(values['bare_one']):,.0f}"),
            Row("the trainer's samples/s / the bare DDP loop's, both 2 ranks", same_work.median, Goal(">=", 1.0),
                spread=same_work.spread, notes="the same work, round by round: what the trainer's own machinery "
                                                "(loader, metrics, stop vote, heartbeats) costs at 2 ranks")]
    return rows, {"trainer_samples_per_s": values, "trainer_steps": steps, "trainer_log_every": log_every}


def _where_time_went(times: PhaseTimes, phase: str, cpu_efficiency: float) -> str:
    optimizer_ms = times.parts(phase)["optimizer"] * 1e3
    return f"{times.describe(phase)}; optimizer {optimizer_ms:.1f} ms; CPU-time efficiency {cpu_efficiency:.2f}"
