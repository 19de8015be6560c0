"""The peers of figure 10: the same training written with Hugging Face Accelerate or Lightning Fabric.

``torchrun --nproc-per-node 2 -m bench.workers.peer_loop {accelerate,fabric} STEPS LOG_EVERY OUT``: each rank
trains the ConvNet (fused AdamW, as the trainer's, batch 128 per rank, one thread) on Fashion-MNIST held in
memory, through the framework's own data loader preparation, gradient sync and backward; it adds up loss
and correct answers on the device every step and, every LOG_EVERY steps, reduces them across ranks and reads
them, as the trainer's metrics windows do. Rank 0 writes every window's samples per second (both ranks').
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bench.harness.data import as_float_tensors, fashion_mnist_train
from trainer.models import ConvNet

BATCH_SIZE = 128


class Peer:
    """What differs between the frameworks: setting up, backward, reducing, who is rank 0."""

    world_size: int
    is_main: bool

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader[Any]) -> tuple[Any, ...]:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class AcceleratePeer(Peer):
    def __init__(self) -> None:
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=True)
        self.world_size, self.is_main = self.accelerator.num_processes, self.accelerator.is_main_process

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader[Any]) -> tuple[Any, ...]:
        return tuple(self.accelerator.prepare(model, optimizer, loader))

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(values, reduction="sum")


class FabricPeer(Peer):
    def __init__(self) -> None:
        from lightning_fabric import Fabric

        # Under torchrun, Fabric takes the ranks from its environment; "ddp" over gloo on the CPU.
        self.fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2, num_nodes=1)
        self.fabric.launch()
        self.world_size, self.is_main = self.fabric.world_size, self.fabric.global_rank == 0

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader[Any]) -> tuple[Any, ...]:
        model, optimizer = self.fabric.setup(model, optimizer)
        return model, optimizer, self.fabric.setup_dataloaders(loader)

    def backward(self, loss: torch.Tensor) -> None:
        self.fabric.backward(loss)

    def reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        return self.fabric.all_reduce(values, reduce_op="sum")


PEERS: dict[str, Callable[[], Peer]] = {"accelerate": AcceleratePeer, "fabric": FabricPeer}


def train(peer: Peer, steps: int, log_every: int) -> list[float]:
    images, labels = as_float_tensors(fashion_mnist_train())
    torch.manual_seed(0)
    model = ConvNet(1, (28, 28), 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    loader = DataLoader(TensorDataset(images, labels), batch_size=BATCH_SIZE, shuffle=True, drop_last=True)
    model, optimizer, loader = peer.setup(model, optimizer, loader)
    windows: list[float] = []
    totals = torch.zeros(3)  # loss sum, correct, samples: on the device, read at log steps only
    step = 0
    started = time.perf_counter()
    while step < steps:
        for inputs, targets in loader:
            outputs = model(inputs)
            loss = nn.functional.cross_entropy(outputs, targets)
            peer.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            totals += torch.stack([loss.detach() * len(targets), (outputs.argmax(1) == targets).sum(),
                                   torch.tensor(float(len(targets)))])
            step += 1
            if step % log_every == 0:
                reduced = peer.reduce_sum(totals).tolist()
                windows.append(reduced[2] / (time.perf_counter() - started))
                totals.zero_()
                started = time.perf_counter()
            if step == steps:
                break
    return windows


def main(argv: list[str]) -> int:
    name, steps, log_every, out = argv[0], int(argv[1]), int(argv[2]), Path(argv[3])
    torch.set_num_threads(1)  # as the trainer runs it is compared with (--threads-per-rank 1)
    peer = PEERS[name]()
    windows = train(peer, steps, log_every)
    if peer.is_main:
        out.write_text(json.dumps(windows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
