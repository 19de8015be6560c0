"""Figure 9: an image folder of 64x64 JPEG files feeding ResNet-18, against the same images in memory.

Both are the trainer at world size 1 (one thread, torchvision's ResNet-18, batch 32, AdamW), run one
after the other, round after round: ``--dataset imagefolder`` with the default --num-workers (auto:
here one worker, which decodes while the step runs), and a task holding the very same images decoded
in memory (bench/workers/in_memory_images.py). A run's value is the median samples/s of its logged
windows, the first left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import count
from pathlib import Path

from bench.harness.context import Context
from bench.harness.launch import TRAINER_QUIET, run_trainer
from bench.harness.measure import Ratio, interleave, load_average, paired_ratio
from bench.harness.results import FigureResult, Goal, Row

TITLE = "Image folder input (JPEG 64x64, ResNet-18)"
GOAL = Goal(">=", 0.95)
CLASSES, SIZE = 10, 64


def write_images(folder: Path, per_class: int, size: int = SIZE) -> None:
    """Real JPEG files, textured so that they do not compress to nothing: what a photo folder holds."""
    import torch
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for label in range(CLASSES):
        (folder / f"class{label}").mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            pixels = torch.randint(0, 256, (size, size, 3), generator=generator, dtype=torch.uint8)
            Image.fromarray(pixels.numpy()).save(folder / f"class{label}" / f"{index:04d}.jpg", quality=90)


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    images = ctx.scratch("image-folder")
    per_class = ctx.pick(96, 16)
    write_images(images, per_class)
    steps, log_every = ctx.pick(24, 6), ctx.pick(4, 2)
    common = ["--epochs", "20", "--max-steps", str(steps), "--log-every", str(log_every), "--batch-size", "32",
              "--eval-batch-size", "64", "--image-size", str(SIZE), "--model", "torchvision/resnet18"]
    values, ratio = folder_against_memory(ctx, images, common, "image-folder", ctx.pick(3, 1), ctx.pick(900, 300))
    rows = [Row("image folder (JPEG, default workers) samples/s / the same images in memory", ratio.median, GOAL,
                spread=ratio.spread,
                notes=f"{CLASSES * per_class} JPEG files of {SIZE}x{SIZE}; torchvision/resnet18, batch 32, one thread; "
                      f"--num-workers auto (1 here); median of {steps // log_every - 1} windows of {log_every} steps")]
    return FigureResult(9, "imagefolder", TITLE, rows, {"samples_per_s": values, "steps": steps,
                                                       "load_average": [load_before, load_average()]})


def folder_against_memory(ctx: Context, images: Path, common: list[str], name: str, rounds: int, timeout_s: float,
                          quiet: Sequence[str] = TRAINER_QUIET) -> tuple[dict[str, list[float]], Ratio]:
    """The trainer over the image folder (``--dataset imagefolder``) and over the same images decoded in memory
    (bench/workers/in_memory_images.py), alternately for ``rounds``; each run's steady samples/s, and the
    folder / memory ratio round by round."""
    values = folder_runs(ctx, images, common, name, rounds, timeout_s, {"folder": ()}, quiet)
    return values, paired_ratio(values["folder"], values["in_memory"])


def folder_runs(ctx: Context, images: Path, common: list[str], name: str, rounds: int, timeout_s: float,
                folders: Mapping[str, Sequence[str]], quiet: Sequence[str] = TRAINER_QUIET) -> dict[str, list[float]]:
    """The trainer over the image folder once for each of ``folders`` (a name and the flags it adds), and over the
    same images decoded in memory ("in_memory"), one after the other for ``rounds``: each run's steady samples/s."""
    folder_args = ["--dataset", "imagefolder", "--data-dir", str(images), "--eval-fraction", "0.1", *common]
    memory_args = ["--task", "bench.workers.in_memory_images:InMemoryImages", "--data-dir", str(images), *common]
    runs = count()

    def measure(args: list[str]) -> float:
        output = ctx.scratch(f"{name}-run-{next(runs)}")
        return run_trainer(args, output, None, timeout_s, quiet=quiet).steady_samples_per_s()

    arms = {label: (lambda flags=flags: measure([*folder_args, *flags])) for label, flags in folders.items()}
    return interleave({**arms, "in_memory": lambda: measure(memory_args)}, rounds=rounds)
