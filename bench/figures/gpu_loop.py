"""GPU figure 1: ResNet-50 on 224x224 synthetic images, bf16, channels-last: the trainer against a minimal
hand-written loop, Hugging Face Accelerate and Lightning Fabric doing the same work; and peak GPU memory.

All four train on one GPU, one after the other, round after round (bench/workers/gpu_loop.py for the three
references): the trainer's built-in task with ``--dataset synthetic``, the same generated images held in host
memory as uint8, torchvision's ResNet-50, fused AdamW, bf16 autocast, channels-last and cuDNN's autotuner
(the trainer's ``auto`` on CUDA). A run's value is the median samples/s of its metrics windows after the first.
Memory: the trainer's peak allocated memory (summary.json) over the minimal loop's, same round. Where a speed
goal is missed, one more trainer run profiles three steady steps (not timed), summarised into results.json's
details (bench/harness/profile_summary.py): where the time goes.

Smoke mode (``--quick``, CI, on the CPU): torchvision's ResNet-18 on 32x32 images, a few steps; every code
path runs, and no memory row is measured (the CPU keeps no allocator peak).
"""

from __future__ import annotations

from itertools import count

from bench.harness.context import Context
from bench.harness.gpu import GPU_QUIET, ImageNetLike, loop_command, memory_row, read_loop_result
from bench.harness.launch import run as run_command
from bench.harness.launch import run_trainer
from bench.harness.measure import interleave, load_average, median, paired_ratio
from bench.harness.profile_summary import profile_summary
from bench.harness.results import FigureResult, Goal, Row
from bench.workers.gpu_loop import LOOPS

TITLE = "ResNet-50 bf16 channels-last on one GPU: trainer against the minimal loop and the peers"
LABELS = {"minimal": ("minimal hand-written loop", Goal(">=", 0.98)),
          "accelerate": ("Hugging Face Accelerate", Goal(">=", 1.0)),
          "fabric": ("Lightning Fabric", Goal(">=", 1.0))}
MEMORY_GOAL = Goal("<=", 1.05)


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    work = ImageNetLike.for_context(ctx)
    runs = count()
    peaks: dict[str, list[float | None]] = {"trainer": [], "minimal": []}

    def trainer() -> float:
        output = ctx.scratch(f"gpu-loop-trainer-{next(runs)}")
        done = run_trainer(work.trainer_args(), output, None, ctx.pick(600, 300), quiet=GPU_QUIET)
        peaks["trainer"].append(done.peak_memory_gib())
        return done.steady_samples_per_s()

    def reference(name: str) -> float:
        out = ctx.scratch("gpu-loop") / f"{name}-{next(runs)}.json"
        run_command(loop_command(name, work, out), ctx.pick(600, 300))
        windows, peak = read_loop_result(out)
        if name == "minimal":
            peaks["minimal"].append(peak)
        return median(windows[1:])

    values = interleave({"trainer": trainer, **{name: lambda name=name: reference(name) for name in LOOPS}},
                        rounds=ctx.pick(2, 1))
    rows = []
    for name, (label, goal) in LABELS.items():
        ratio = paired_ratio(values["trainer"], values[name])
        rows.append(Row(f"trainer samples/s / {label} samples/s", ratio.median, goal, spread=ratio.spread,
                        notes=f"median of {len(ratio.rounds)} round(s); {work.describe()}; trainer "
                              f"{median(values['trainer']):,.0f}, {name} {median(values[name]):,.0f} samples/s "
                              f"(medians)"))
    rows.append(memory_row("trainer peak allocated GPU memory / the minimal loop's (its evaluation and "
                           "checkpoint included)", peaks, MEMORY_GOAL))
    details = {"samples_per_s": values, "peak_memory_gib": peaks, "work": work.describe(),
               "load_average": [load_before, load_average()]}
    if any(row.met is False for row in rows[:len(LABELS)]) or ctx.quick:  # smoke mode: the code path, always
        first = max(2, work.steps - 3)
        output = ctx.scratch("gpu-loop-trainer-profiled")
        run_trainer(work.trainer_args("--profile-steps", f"{first}-{min(work.steps, first + 2)}"), output, None,
                    ctx.pick(600, 300), quiet=GPU_QUIET)
        details["profile"] = profile_summary(output)
    return FigureResult(1, "gpu-loop", TITLE, rows, details)
