"""The ledger task: a record of what was trained, one number per sample, for the tests that count every sample
once across resumes, resizes and membership changes (``--task tests.support.ledger:LedgerTask``).

It imports only torch and the trainer, so a container of the trainer's image runs it from a mounted folder
(``--task ledger:PacedLedgerTask`` with this folder on PYTHONPATH, tests/deploy/test_docker.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

from trainer.options import ResumeRule, option
from trainer.task import Task, TaskContext, TaskData


@dataclass
class LedgerOptions:
    train_size: int = option(98, "training samples", resume=ResumeRule.REFUSE)


class IndexItems(Dataset[tuple[torch.Tensor, float]]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, float]:
        return torch.tensor(index), 0.0


class LedgerTask(Task[LedgerOptions]):
    """A ledger of what is trained, not of what is fetched: sample i's input is i, and the model is one
    number per sample, starting at 0, whose loss is the batch's mean. Under SGD with lr 1 and no momentum, a
    step moves the number of each sample it trains by -(that sample's weight in the step's gradient): -1/N
    when the step's gradient is the mean over its N real samples. A sample trained twice, or fetched as padding
    and trained, moves twice or by another amount; one never trained stays at 0."""

    name = "ledger"
    Options = LedgerOptions

    def datasets(self, context: TaskContext) -> TaskData:
        return TaskData(IndexItems(self.options.train_size), IndexItems(8), deterministic_items=True)

    def model(self, data: TaskData) -> nn.Module:
        ledger = nn.Embedding(self.options.train_size, 1)
        nn.init.zeros_(ledger.weight)
        return ledger

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return outputs.float().mean() + 0 * targets.float().mean()


@dataclass
class PacedLedgerOptions(LedgerOptions):
    step_delay_s: float = option(0.0, "seconds each loss call waits (a membership change fits mid-epoch)")


class PacedLedgerTask(LedgerTask):
    """The ledger, each step held for a moment: long enough for a test to kill a node, or add one, mid-epoch."""

    name = "paced-ledger"
    Options = PacedLedgerOptions

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        time.sleep(self.options.step_delay_s)
        return super().loss(outputs, targets)


@dataclass
class ShardLedgerOptions(LedgerOptions):
    shards: str = option("", "the ledger's samples as shards (write_ledger_shards): a folder or URL",
                         resume=ResumeRule.REFUSE)
    step_delay_s: float = option(0.0, "seconds each loss call waits (a node killed mid-epoch fits)")
    store_attempts: int = option(6, "attempts per request to the shards' store while opening them")


def decode_ledger(members: dict[str, bytes]) -> tuple[torch.Tensor, float]:
    return torch.tensor(int(members["idx"])), 0.0


def write_ledger_shards(url: str, size: int, samples_per_shard: tuple[int, ...]) -> None:
    """Sample i holds the number i; shards of the given sizes in turn (uneven, as a real writer's last ones are)."""
    from trainer.data.shards.writer import ShardWriter

    writer = ShardWriter(url, 1 << 30)
    sample, shard = 0, 0
    while sample < size:
        for _ in range(min(samples_per_shard[shard % len(samples_per_shard)], size - sample)):
            writer.add("train", f"{sample:06d}", {"idx": str(sample).encode()})
            sample += 1
        writer._flush("train")
        shard += 1
    for sample in range(8):
        writer.add("eval", f"{sample:06d}", {"idx": str(sample).encode()})
    writer.close({})


class ShardLedgerTask(LedgerTask):
    """The ledger, its samples streamed from shards (--shards URL): each sample's member .idx is its number."""

    name = "shard-ledger"
    Options = ShardLedgerOptions

    def datasets(self, context: TaskContext) -> TaskData:
        from trainer.data.shards import RetryPolicy, ShardedDataset

        retry = RetryPolicy(attempts=self.options.store_attempts, first_backoff_s=0.2)
        train, evaluation = ShardedDataset.splits(self.options.shards, ("train", "eval"), decode_ledger, retry)
        return TaskData(train, evaluation, deterministic_items=True)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        time.sleep(self.options.step_delay_s)
        return super().loss(outputs, targets)
