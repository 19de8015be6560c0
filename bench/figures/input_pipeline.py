"""Figure 4: the input pipeline: the trainer's loader over the dataset read from disk, against tensors in memory.

Both feed the same training step (ConvNet, AdamW, batch 128, one thread) in this process, in
alternating windows. The loader is built as the trainer builds it (trainer.build.training_loader: the
resumable sampler, over the dataset trainer.data read from the IDX files); the reference cycles through
batches taken from that loader beforehand, already normalised float tensors. The one-time read of the
files is timed too and set against an epoch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from torch import nn

from bench.harness.context import Context
from bench.harness.data import fashion_mnist_train
from bench.harness.measure import interleave, load_average, median, paired_ratio
from bench.harness.results import FigureResult, Goal, Row
from trainer.build import training_loader
from trainer.data import collate_batch
from trainer.models import ConvNet
from trainer.sampler import ResumableDistributedSampler

TITLE = "Input pipeline"
GOAL = Goal(">=", 0.95)
BATCH_SIZE = 128
IN_MEMORY_BATCHES = 8


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    torch.set_num_threads(1)  # as every trainer rank measured here (--threads-per-rank 1)
    started = time.perf_counter()
    train = fashion_mnist_train()
    read_s = time.perf_counter() - started
    loader, sampler = training_loader(train, world_size=1, rank=0, batch_size=BATCH_SIZE, num_workers=0, seed=0,
                                      deterministic_items=True, collate_fn=collate_batch)
    stream = _endless(loader, sampler)
    in_memory = [next(stream) for _ in range(IN_MEMORY_BATCHES)]
    torch.manual_seed(0)
    model = ConvNet(1, (28, 28), 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = ctx.pick(12, 3)

    def window(batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        _train_step(model, optimizer, next(batches))  # the other source's cache footprint is gone after this one
        started = time.perf_counter()
        for _ in range(steps):
            _train_step(model, optimizer, next(batches))
        return steps * BATCH_SIZE / (time.perf_counter() - started)

    cycle = _cycle(in_memory)
    values = interleave({"loader": lambda: window(stream), "in_memory": lambda: window(cycle)},
                        rounds=ctx.pick(5, 1))
    ratio = paired_ratio(values["loader"], values["in_memory"])
    epoch_s = len(train) / median(values["in_memory"])
    row = Row("trainer's loader from disk / tensors in memory (samples/s)", ratio.median, GOAL, spread=ratio.spread,
              notes=f"{len(train)} images read from the IDX files once in {read_s:.2f} s, "
                    f"{100 * read_s / epoch_s:.1f}% of an epoch's training time; num_workers 0 (the default)")
    details = {"samples_per_s": values, "read_s": read_s, "train_samples": len(train), "steps": steps,
               "load_average": [load_before, load_average()]}
    return FigureResult(4, "input", TITLE, [row], details)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    images, labels = batch
    nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _endless(loader: torch.utils.data.DataLoader, sampler: ResumableDistributedSampler
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches epoch after epoch, as the trainer draws them (set_epoch before each)."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _cycle(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        yield from batches
