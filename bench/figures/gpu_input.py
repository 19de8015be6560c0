"""GPU figure 2: an image folder of JPEG files feeding ResNet-50 on the GPU, against the same images in memory,
with the JPEGs decoded on the GPU (--image-decode device: nvJPEG, a batch at a time) and in the workers (Pillow).

All three are the trainer on one GPU (bf16, channels-last, batch 128), run one after the other, round after
round: ``--dataset imagefolder`` over 256x256 JPEG files, resized and centre-cropped to 224 by the trainer, with
4 DataLoader workers (the most the goal allows a GPU) decoding on the device or in the workers, against a task
holding the very same images decoded in memory (bench/workers/in_memory_images.py). A run's value is the median
samples/s of its windows after the first. Whether the input keeps the GPU fed is the question.

Smoke mode: 40x40 files cropped to 32, ResNet-18, a few steps, on any device (on the CPU, --image-decode device
decodes with torchvision's CPU decoder).
"""

from __future__ import annotations

from bench.figures.image_folder import CLASSES, folder_runs, write_images
from bench.harness.context import Context
from bench.harness.gpu import GPU_QUIET
from bench.harness.measure import load_average, median, paired_ratio
from bench.harness.results import FigureResult, Goal, Row

TITLE = "Image folder input on the GPU (JPEG decoded on the GPU and in workers, ResNet-50 bf16)"
GOAL = Goal(">=", 0.95)
WORKERS = 4  # DataLoader workers per GPU: the goal's limit (a GPU node rarely has more cores per GPU to spare)
ARMS = {"device": ("--image-decode", "device", "--num-workers", str(WORKERS)),
        "workers": ("--image-decode", "workers", "--num-workers", str(WORKERS))}


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    images = ctx.scratch("gpu-image-folder")
    per_class, file_size, size = ctx.pick(300, 16), ctx.pick(256, 40), ctx.pick(224, 32)
    write_images(images, per_class, file_size)
    model, batch = ctx.pick("torchvision/resnet50", "torchvision/resnet18"), ctx.pick(128, 8)
    steps, log_every = ctx.pick(20, 6), ctx.pick(4, 2)
    common = ["--epochs", "20", "--max-steps", str(steps), "--log-every", str(log_every), "--batch-size", str(batch),
              "--eval-batch-size", str(batch), "--image-size", str(size), "--model", model, "--precision", "bf16"]
    values = folder_runs(ctx, images, common, "gpu-image-folder", ctx.pick(2, 1), ctx.pick(600, 300), ARMS,
                         quiet=GPU_QUIET)
    work = (f"{CLASSES * per_class} JPEG files of {file_size}x{file_size} cropped to {size}; {model}, batch {batch}, "
            f"bf16; {WORKERS} workers; median of {steps // log_every - 1} windows of {log_every} steps")
    memory = median(values["in_memory"])
    rows = []
    for arm, label, goal in (("device", "decoded on the GPU (--image-decode device)", GOAL),
                             ("workers", "decoded in the workers (Pillow)", None)):
        ratio = paired_ratio(values[arm], values["in_memory"])
        rows.append(Row(f"image folder, {label}, samples/s / the same images in memory", ratio.median, goal,
                        spread=ratio.spread, notes=f"{work}; folder {median(values[arm]):,.0f}, in memory "
                                                   f"{memory:,.0f} samples/s"))
    return FigureResult(2, "gpu-input", TITLE, rows, {"samples_per_s": values, "steps": steps, "workers": WORKERS,
                                                      "load_average": [load_before, load_average()]})
