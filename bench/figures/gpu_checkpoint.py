"""GPU figure 3: checkpoints of a training state that lives on the GPU.

Figure 7's measurements (bench/figures/checkpointing.py) with the model, its AdamW state and the overlapped
forward and backward pass on ``cuda:0``: a state of about 1 GB (torchvision's ViT-B/16 + AdamW, 86.6 M
parameters, three float32 tensors each) saved synchronously against a raw write + fsync of the same bytes,
and the time an asynchronous save blocks training (its copy to host memory included) against a
synchronous save. Interleaved, median of the repeats.

Smoke mode: the ConvNet on whatever device there is (the CPU in CI).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from bench.figures.checkpointing import measure, training_state
from bench.harness.context import Context
from bench.harness.measure import load_average
from bench.harness.results import FigureResult, Goal, Row
from trainer.config import DistConfig
from trainer.distributed import process_group
from trainer.launchers import identity_from_env

TITLE = "Checkpointing from the GPU"


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model_name, size, classes = ctx.pick(("torchvision/vit_b_16", 224, 1000), ("convnet", 32, 10))
    repeats = ctx.pick(3, 2)
    work = Path(tempfile.mkdtemp(prefix="gpu-checkpoint-bench-", dir=ctx.work_dir))
    try:
        # DistConfig takes auto, cpu or cuda; the device itself (cuda:0) is passed beside it.
        with process_group(DistConfig(device=device.type), identity_from_env({}), device) as runtime:
            parts, position, model = training_state(model_name, device, size, classes)
            batch = torch.randn(ctx.pick(32, 8), 3, size, size, device=device)
            result = measure(model_name, parts, position, model, work, runtime, repeats, batch)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    label = f"{result['state']} on {device.type}, {result['bytes'] / 1e9:.2f} GB"
    rate, median = result["gb_per_s"], result["median_s"]
    rows = [
        Row(f"save throughput / raw write+fsync of the same bytes ({label})", result["save_vs_raw_throughput"],
            Goal(">=", 0.9), notes=f"save {rate['sync_save']} GB/s, raw {rate['raw_write_fsync']} GB/s, median of "
                                   f"{repeats}"),
        Row(f"asynchronous save's blocked time / synchronous save ({label})", result["async_blocked_vs_sync_save"],
            Goal("<=", 0.05),
            notes=f"blocked {median['async_blocked'] * 1e3:.1f} ms (save(), the copies' cost to a "
                  f"{median['forward_backward_alone'] * 1e3:.0f} ms forward and backward, the wait before the next "
                  f"optimizer step), sync save "
                  f"{median['sync_save'] * 1e3:.1f} ms; every tensor copied at save: "
                  f"{median['async_blocked_all_copied_at_save'] * 1e3:.1f} ms"),
    ]
    details = {"result": result, "device": str(device), "load_average": [load_before, load_average()]}
    return FigureResult(3, "gpu-checkpoint", TITLE, rows, details)
