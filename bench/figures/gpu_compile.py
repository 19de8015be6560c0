"""GPU figure 5: --compile against eager under --sync ddp and --sync fsdp on one GPU: samples/s and compile time.

Figure 1's work (ResNet-50 bf16, channels-last, synthetic 224x224 images, batch 256), the trainer at one rank
under torchrun, each of the four runs once per round. A run's value is the median samples/s of its metrics
windows after the first, which holds the compilation. Compile time is what a compiled run takes to its first
logged window beyond what the eager run of the same method takes (the first window's end, from the launch):
the cost a user waits through before the first log line, recompilations in that window included.

Smoke mode: figure 1's smoke work with the small ConvNet in ResNet-18's place (the CPU compiles too, with the C++
backend, and a ResNet's graphs take it minutes on 2 cores), under fsdp only (the same code as ddp's; CI's time), on
any device.
"""

from __future__ import annotations

from itertools import count

from bench.harness.context import Context
from bench.harness.gpu import GPU_QUIET, ImageNetLike
from bench.harness.launch import TrainerRun, first_step_time, run_trainer
from bench.harness.measure import interleave, load_average, median, paired_ratio
from bench.harness.results import FigureResult, Row

TITLE = "torch.compile on one GPU: --compile / eager under DDP and FSDP (speed, compile time)"
METHODS = ("ddp", "fsdp")


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    work = ImageNetLike.for_context(ctx)
    runs = count()
    to_first_window: dict[str, list[float]] = {}
    peaks: dict[str, list[float | None]] = {}

    def trainer(method: str, compiled: bool) -> float:
        arm = f"{method}-{'compiled' if compiled else 'eager'}"
        output = ctx.scratch(f"gpu-compile-{arm}-{next(runs)}")
        flags = ["--sync", method, *(["--compile"] if compiled else []), *ctx.pick([], ["--model", "convnet"])]
        done: TrainerRun = run_trainer(work.trainer_args(*flags), output, 1, ctx.pick(900, 600), quiet=GPU_QUIET)
        to_first_window.setdefault(arm, []).append(first_step_time(done.records) - done.launched_at)
        peaks.setdefault(arm, []).append(done.peak_memory_gib())
        return done.steady_samples_per_s()

    methods = ctx.pick(METHODS, ("fsdp",))
    arms = {f"{method}-{kind}": (lambda method=method, compiled=(kind == "compiled"): trainer(method, compiled))
            for method in methods for kind in ("eager", "compiled")}
    values = interleave(arms, rounds=1)
    described = work.describe().replace(work.model, ctx.pick(work.model, "convnet"))
    rows = []
    for method in methods:
        speed = paired_ratio(values[f"{method}-compiled"], values[f"{method}-eager"])
        compile_s = median([compiled - eager for compiled, eager in zip(to_first_window[f"{method}-compiled"],
                                                                        to_first_window[f"{method}-eager"],
                                                                        strict=True)])
        rows.append(Row(f"--compile samples/s / eager samples/s (--sync {method}, 1 rank)", speed.median,
                        spread=speed.spread,
                        notes=f"{described}; compiled {median(values[f'{method}-compiled']):,.0f}, eager "
                              f"{median(values[f'{method}-eager']):,.0f} samples/s; compile time about "
                              f"{compile_s:.0f} s (to the first window, beyond eager's)"))
    details = {"samples_per_s": values, "seconds_to_first_window": to_first_window, "peak_memory_gib": peaks,
               "work": described, "load_average": [load_before, load_average()]}
    return FigureResult(5, "gpu-compile", TITLE, rows, details)
