"""The references of the GPU figure: the trainer's work written by hand, with Accelerate, and with Fabric.

``python -m bench.workers.gpu_loop {minimal,accelerate,fabric} --out OUT [--model M --shape C,H,W ...]`` trains
on one device (``cuda:0`` when there is one, else the CPU: the smoke mode) what the trainer's built-in task
trains with ``--dataset synthetic``: the same generated images (trainer.data.synthetic, uint8 in host memory),
the same model (``--model``, as trainer.models builds it), fused AdamW, bf16 autocast, and on CUDA channels-last
and cuDNN's autotuner. Each adds up loss and correct answers on the device every step and reads them every
LOG_EVERY steps, as the trainer's metrics windows do. It writes ``{"windows": [samples/s of each window],
"peak_memory_gib": torch.cuda.max_memory_allocated() or null on the CPU}``.

The minimal loop is the shortest fast loop a user would write: a batch gathered from host memory, copied
to the device (pinned, non-blocking) and normalised there. The peers feed a ``DataLoader`` over the same
tensors through their own preparation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer.data import cached_synthetic
from trainer.models import build_model


class Loop:
    """What differs between the three: preparing model, optimizer and batches; backward."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
              batch_size: int) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], Iterator[Any]]]:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


class MinimalLoop(Loop):
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
              batch_size: int) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], Iterator[Any]]]:
        pin = self.device.type == "cuda"
        generator = torch.Generator().manual_seed(0)

        def batches() -> Iterator[Any]:
            order = torch.randperm(len(labels), generator=generator)
            for start in range(0, len(order) - batch_size + 1, batch_size):
                rows = order[start:start + batch_size]
                inputs, targets = images[rows], labels[rows]
                if pin:
                    inputs, targets = inputs.pin_memory(), targets.pin_memory()
                yield inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

        return model, optimizer, batches


class AccelerateLoop(Loop):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        from accelerate import Accelerator

        self.accelerator = Accelerator(mixed_precision="bf16", cpu=device.type == "cpu")

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
              batch_size: int) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], Iterator[Any]]]:
        loader = DataLoader(TensorDataset(images, labels), batch_size=batch_size, shuffle=True, drop_last=True,
                            pin_memory=self.device.type == "cuda")
        model, optimizer, loader = self.accelerator.prepare(model, optimizer, loader)
        return model, optimizer, lambda: iter(loader)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def autocast(self) -> Any:
        return self.accelerator.autocast()


class FabricLoop(Loop):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        from lightning_fabric import Fabric

        self.fabric = Fabric(accelerator=device.type, devices=1, precision="bf16-mixed")
        self.fabric.launch()

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
              batch_size: int) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], Iterator[Any]]]:
        loader = DataLoader(TensorDataset(images, labels), batch_size=batch_size, shuffle=True, drop_last=True,
                            pin_memory=self.device.type == "cuda")
        model, optimizer = self.fabric.setup(model, optimizer)
        loader = self.fabric.setup_dataloaders(loader)
        return model, optimizer, lambda: iter(loader)

    def backward(self, loss: torch.Tensor) -> None:
        self.fabric.backward(loss)

    def autocast(self) -> Any:
        return self.fabric.autocast()


LOOPS: dict[str, Callable[[torch.device], Loop]] = {"minimal": MinimalLoop, "accelerate": AccelerateLoop,
                                                    "fabric": FabricLoop}


def train(loop: Loop, args: argparse.Namespace) -> list[float]:
    shape = tuple(int(size) for size in args.shape.split(","))
    # The trainer's very images, from the bench's cache (generated once per bench run).
    train_set, _, info = cached_synthetic(args.cache_dir, shape, args.classes, args.train_size,  # type: ignore[arg-type]
                                          args.test_size)
    scale = (1.0 / (255.0 * torch.tensor(train_set.std))).view(1, -1, 1, 1).to(loop.device)
    shift = (-torch.tensor(train_set.mean) / torch.tensor(train_set.std)).view(1, -1, 1, 1).to(loop.device)
    torch.manual_seed(0)
    cuda = loop.device.type == "cuda"
    torch.backends.cudnn.benchmark = cuda
    layout = torch.channels_last if cuda else torch.contiguous_format
    model = build_model(args.model, info.in_channels, info.image_size, info.num_classes)
    model = model.to(loop.device, memory_format=layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, optimizer, batches = loop.setup(model, optimizer, train_set.images, train_set.labels, args.batch_size)
    totals = torch.zeros(2, device=loop.device)  # loss sum, correct: read at window ends only
    # Counted on the host: a count built on the device each step (torch.tensor(n, device=...)) is a blocking copy,
    # which made every step wait for the GPU (the first GPU run's references did, 2026-11-25).
    samples = 0
    windows: list[float] = []
    step = 0
    started = time.perf_counter()
    while step < args.steps:
        for images, targets in batches():
            inputs = (images.float() * scale + shift).contiguous(memory_format=layout)
            with loop.autocast():
                outputs = model(inputs)
                loss = nn.functional.cross_entropy(outputs.float(), targets)
            loop.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            totals += torch.stack([loss.detach() * len(targets), (outputs.argmax(1) == targets).sum()])
            samples += len(targets)
            step += 1
            if step % args.log_every == 0:
                totals.tolist()  # waits for the device, as the trainer's window does
                windows.append(samples / (time.perf_counter() - started))
                totals.zero_()
                samples = 0
                started = time.perf_counter()
            if step == args.steps:
                break
    return windows


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.workers.gpu_loop")
    parser.add_argument("loop", choices=list(LOOPS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--shape", required=True, help="C,H,W")
    for name in ("--classes", "--train-size", "--test-size", "--batch-size", "--steps", "--log-every"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--cache-dir", type=Path, required=True, help="where the generated images are kept")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    torch.set_num_threads(os.cpu_count() or 1)  # as the trainer runs in these figures (bench.harness.gpu)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    windows = train(LOOPS[args.loop](device), args)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    args.out.write_text(json.dumps({"windows": windows, "peak_memory_gib": peak}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
