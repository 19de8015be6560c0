"""The reference of figures 1 and 3: the shortest hand-written loop over the trainer's model and data.

``python -m bench.workers.minimal_loop STEPS LOG_EVERY OUT`` trains the ConvNet (fused AdamW, as the
trainer's, batch 128, one thread) on Fashion-MNIST held in memory as normalised float tensors, and writes
the samples per second of each window of LOG_EVERY steps, timed like the trainer's metrics windows. Under
torchrun with 2 ranks it is the bare DDP loop of figure 1: each rank takes every other batch of the order,
DDP over gloo, and rank 0 writes both ranks' samples per second.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bench.harness.data import as_float_tensors, fashion_mnist_train
from trainer.models import ConvNet

BATCH_SIZE = 128


def train(steps: int, log_every: int, rank: int = 0, world_size: int = 1) -> list[float]:
    images, labels = as_float_tensors(fashion_mnist_train())
    torch.manual_seed(0)
    model: nn.Module = ConvNet(1, (28, 28), 10)
    if world_size > 1:
        model = DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    order = torch.randperm(len(labels))
    windows = []
    started = time.perf_counter()
    for step in range(steps):
        batch = step * world_size + rank
        rows = order[(batch * BATCH_SIZE) % len(order):][:BATCH_SIZE]
        loss = nn.functional.cross_entropy(model(images[rows]), labels[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % log_every == 0:
            windows.append(world_size * log_every * BATCH_SIZE / (time.perf_counter() - started))
            started = time.perf_counter()
    return windows


def main(argv: list[str]) -> int:
    steps, log_every, out = int(argv[0]), int(argv[1]), Path(argv[2])
    torch.set_num_threads(1)  # as the trainer runs it is compared with (--threads-per-rank 1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        out.write_text(json.dumps(train(steps, log_every)))
        return 0
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        windows = train(steps, log_every, rank, world_size)
        if rank == 0:
            out.write_text(json.dumps(windows))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
