"""GPU figure 4: --sync fsdp against --sync ddp on one GPU: peak memory and speed.

The trainer under torchrun with one rank on the GPU (NCCL allows one rank per GPU), ResNet-50 bf16 on
synthetic 224x224 images (figure 1's work), each method once per round, alternately. At world size 1 FSDP2
shards over a mesh of one: nothing is divided, so the figure shows what its wrapping costs on a GPU (the
per-unit all-gathers become copies, mixed precision keeps an fp32 master copy beside the bf16 parameters)
and what memory it needs beside DDP's; its memory savings need more ranks than one GPU holds (figure 11 shows
them at 2 ranks on the CPU). Memory: each run's peak allocated memory from summary.json.

Then one more run of each with --profile-steps over three steady steps: the trace (kernel time by kernel, the
copies, FSDP's own ranges) and the allocator's history (what was live at the peak, by where it was allocated),
summarised into results.json's details (bench/harness/profile_summary.py): where FSDP's time and memory go,
beside DDP's. Those runs are not timed.

Smoke mode: figure 1's smoke work on any device; no memory row on the CPU.
"""

from __future__ import annotations

from itertools import count

from bench.harness.context import Context
from bench.harness.gpu import GPU_QUIET, ImageNetLike, memory_row
from bench.harness.launch import run_trainer
from bench.harness.measure import interleave, load_average, median, paired_ratio
from bench.harness.profile_summary import profile_summary
from bench.harness.results import FigureResult, Row

TITLE = "Sharded data parallel on one GPU: FSDP / DDP (memory, speed)"


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    work = ImageNetLike.for_context(ctx)
    runs = count()
    peaks: dict[str, list[float | None]] = {"fsdp": [], "ddp": []}

    def trainer(method: str) -> float:
        output = ctx.scratch(f"gpu-sharded-{method}-{next(runs)}")
        done = run_trainer(work.trainer_args("--sync", method), output, 1, ctx.pick(600, 300), quiet=GPU_QUIET)
        peaks[method].append(done.peak_memory_gib())
        return done.steady_samples_per_s()

    values = interleave({"fsdp": lambda: trainer("fsdp"), "ddp": lambda: trainer("ddp")}, rounds=ctx.pick(2, 1))
    speed = paired_ratio(values["fsdp"], values["ddp"])
    rows = [Row("FSDP samples/s / DDP samples/s (1 rank)", speed.median, spread=speed.spread,
                notes=f"median of {len(speed.rounds)} round(s); {work.describe()}; fsdp "
                      f"{median(values['fsdp']):,.0f}, ddp {median(values['ddp']):,.0f} samples/s")]
    rows.append(memory_row("FSDP peak allocated GPU memory / DDP's (1 rank)", peaks))
    first = max(2, work.steps - 3)  # three steps after the steady windows began, the last one's included
    steps = f"{first}-{min(work.steps, first + 2)}"
    profiles = {}
    for method in ("fsdp", "ddp"):
        output = ctx.scratch(f"gpu-sharded-{method}-profiled")
        run_trainer(work.trainer_args("--sync", method, "--profile-steps", steps), output, 1, ctx.pick(600, 300),
                    quiet=GPU_QUIET)
        profiles[method] = profile_summary(output)
    details = {"samples_per_s": values, "peak_memory_gib": peaks, "work": work.describe(),
               "profiles": {"steps": steps, **profiles}, "load_average": [load_before, load_average()]}
    return FigureResult(4, "gpu-sharded", TITLE, rows, details)
