"""The reference of figure 3: the shortest hand-written loop over the trainer's model and data.

``python -m bench.workers.minimal_loop STEPS LOG_EVERY OUT`` trains the ConvNet (AdamW, batch 128, one thread)
on Fashion-MNIST held in memory as normalised float tensors, and writes the samples per second of
each window of LOG_EVERY steps, timed like the trainer's metrics windows.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from bench.harness.data import as_float_tensors, fashion_mnist_train
from trainer.models import ConvNet

BATCH_SIZE = 128


def train(steps: int, log_every: int) -> list[float]:
    images, labels = as_float_tensors(fashion_mnist_train())
    torch.manual_seed(0)
    model = ConvNet(1, (28, 28), 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    order = torch.randperm(len(labels))
    windows = []
    started = time.perf_counter()
    for step in range(steps):
        rows = order[(step * BATCH_SIZE) % len(order):][:BATCH_SIZE]
        loss = nn.functional.cross_entropy(model(images[rows]), labels[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % log_every == 0:
            windows.append(log_every * BATCH_SIZE / (time.perf_counter() - started))
            started = time.perf_counter()
    return windows


def main(argv: list[str]) -> int:
    steps, log_every, out = int(argv[0]), int(argv[1]), Path(argv[2])
    torch.set_num_threads(1)  # as the trainer runs it is compared with (--threads-per-rank 1)
    out.write_text(json.dumps(train(steps, log_every)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
