"""What the GPU figures share: the ImageNet-like work they train, and how the trainer and the references run it.

On the GPU machine the work is ResNet-50 on 224x224 images in bf16; in smoke mode (``--quick``, on any
machine, CPU included) it is ResNet-18 on 32x32 images for a few steps, so that CI runs every code path
of the GPU suite in a minute or two.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.harness.context import Context
from bench.harness.measure import median, paired_ratio
from bench.harness.results import Goal, Row

# The trainer as the GPU figures run it: quiet and fresh, with every core's thread (the harness's processes get
# OMP_NUM_THREADS=1, which the trainer would follow; the host side of a GPU step gathers and normalises batches,
# and bench/workers/gpu_loop.py's references use every core too).
HOST_THREADS = os.cpu_count() or 1
GPU_QUIET = ("--progress", "off", "--no-tensorboard", "--resume", "none", "--threads-per-rank", str(HOST_THREADS))


@dataclass(frozen=True)
class ImageNetLike:
    model: str
    shape: tuple[int, int, int]
    classes: int
    batch_size: int
    steps: int
    log_every: int
    # The generated images, made once per bench run and read by every run of the trainer and the references
    # (trainer.data.synthetic.cached_synthetic): generating 7,936 of 224x224 took 54 s of one core here.
    cache_dir: Path

    @classmethod
    def for_context(cls, ctx: Context) -> ImageNetLike:
        cache = ctx.work_dir / "synthetic-cache"
        if ctx.quick:
            return cls("torchvision/resnet18", (3, 32, 32), 10, batch_size=8, steps=6, log_every=2, cache_dir=cache)
        return cls("torchvision/resnet50", (3, 224, 224), 1000, batch_size=256, steps=30, log_every=5,
                   cache_dir=cache)

    @property
    def train_size(self) -> int:
        """One epoch of exactly ``steps`` batches: every window is inside it, no evaluation in between."""
        return self.batch_size * self.steps

    def describe(self) -> str:
        return (f"{self.model}, {'x'.join(map(str, self.shape))} synthetic, batch {self.batch_size}, {self.steps} "
                f"steps in windows of {self.log_every}, bf16")

    def trainer_args(self, *extra: str) -> list[str]:
        return ["--dataset", "synthetic", "--synthetic-shape", ",".join(map(str, self.shape)),
                "--synthetic-classes", str(self.classes), "--synthetic-train-size", str(self.train_size),
                "--synthetic-test-size", str(self.batch_size), "--model", self.model, "--precision", "bf16",
                "--batch-size", str(self.batch_size), "--eval-batch-size", str(self.batch_size), "--epochs", "1",
                "--max-steps", str(self.steps), "--log-every", str(self.log_every), "--data-cache-dir",
                str(self.cache_dir), *extra]


def loop_command(name: str, work: ImageNetLike, out: Path) -> list[str]:
    """bench/workers/gpu_loop.py running reference ``name`` on the same work."""
    return [sys.executable, "-m", "bench.workers.gpu_loop", name, "--out", str(out), "--model", work.model,
            "--shape", ",".join(map(str, work.shape)), "--classes", str(work.classes),
            "--train-size", str(work.train_size), "--test-size", str(work.batch_size), "--batch-size",
            str(work.batch_size), "--steps", str(work.steps), "--log-every", str(work.log_every), "--cache-dir",
            str(work.cache_dir)]


def read_loop_result(out: Path) -> tuple[list[float], float | None]:
    """A reference's windows (samples/s) and its peak allocated GPU memory (None on the CPU)."""
    result = json.loads(out.read_text())
    return [float(value) for value in result["windows"]], result["peak_memory_gib"]


def memory_row(measure: str, peaks: dict[str, list[float | None]], goal: Goal | None = None) -> Row:
    """Peak allocated GPU memory of the first of ``peaks``' two cases over the second's, round by round; not
    measured where either side has none (the CPU keeps no allocator peak)."""
    (mine_name, mine), (theirs_name, theirs) = peaks.items()
    pairs = [(a, b) for a, b in zip(mine, theirs, strict=True) if a is not None and b is not None]
    if not pairs:
        return Row(measure, None, goal, notes="not measured: no CUDA device (the CPU keeps no allocator peak)")
    ratio = paired_ratio([a for a, _ in pairs], [b for _, b in pairs])
    return Row(measure, ratio.median, goal, spread=ratio.spread,
               notes=f"torch.cuda.max_memory_allocated: {mine_name} {median([a for a, _ in pairs]):.2f} GiB, "
                     f"{theirs_name} {median([b for _, b in pairs]):.2f} GiB")
