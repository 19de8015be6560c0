"""The trainer's samplers over a sharded dataset: the same global positions as for map-style data, in an order
that is local in shards (trainer.data.shards.order), and the fetching that follows them (trainer.data.shards.prefetch).

What an epoch's order depends on besides (seed, epoch) is its lanes and window; both are fixed when the epoch
starts (the lanes from the world size then, unless --shard-lanes names them) and saved in the checkpoint, so that
a resume in the middle of an epoch, at any world size, continues that epoch's order. The next epoch takes the
lanes of the world size it starts with.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch

from trainer.data.shards.dataset import ShardedDataset, encode_key
from trainer.data.shards.layout import ShardEntry
from trainer.data.shards.order import ShardOrder, auto_lanes
from trainer.data.shards.prefetch import PlannedWindow, Prefetcher, bytes_open_at_once, rank_plan
from trainer.sampler import ResumableDistributedSampler

__all__ = ["BlockSampler", "CacheBound", "OrderSettings", "ShardedDistributedSampler", "read_ahead_samples"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OrderSettings:
    lanes: int  # 0: auto_lanes(world size at the epoch's start)
    window_shards: float  # a window's samples, in shards' worth


@dataclass(frozen=True)
class CacheBound:
    """What the cache bound's check names in its message (trainer.data.shards.fetching)."""

    flag_gb: float
    rank: int
    local_world_size: int
    evaluation_bytes: int = 0  # of the rank's share, what evaluation holds at most: training has the rest


class ShardedDistributedSampler(ResumableDistributedSampler):
    def __init__(self, dataset: ShardedDataset, num_replicas: int, rank: int, seed: int, batch_size: int,
                 settings: OrderSettings) -> None:
        super().__init__(dataset, num_replicas, rank, seed, batch_size)
        self.sharded = dataset
        self.settings = settings
        self.prefetcher: Prefetcher | None = None
        self.bound: CacheBound | None = None  # once the trainer gave it a cache
        self._saved: dict[str, int] | None = None  # the epoch in progress's order, from a checkpoint
        self.lanes, self.window = self._fresh_parameters()

    def _fresh_parameters(self) -> tuple[int, int]:
        lanes = self.settings.lanes or auto_lanes(self.num_replicas)
        window = max(1, round(self.settings.window_shards * self.sharded.mean_shard_samples))
        return lanes, window

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        super().set_epoch(epoch, start_sample)
        saved = self._saved
        if saved is not None and saved["epoch"] == epoch:
            self.lanes, self.window = saved["lanes"], saved["window"]
        else:
            self.lanes, self.window = self._fresh_parameters()
        self._saved = {"epoch": epoch, "lanes": self.lanes, "window": self.window}

    def order(self) -> ShardOrder:
        return ShardOrder(self.sharded.counts, self.seed, self.epoch, self.lanes, self.window)

    def _positions(self) -> Iterator[int]:
        """This rank's positions, as ResumableDistributedSampler deals them (remaining[rank::W]), then, where the
        last global batch holds nothing of this rank's, a placeholder to step with (weight zero): this rank's own
        last sample, whose piece it holds, rather than the remainder's first (another rank's lane and shard)."""
        size = len(self.dataset)
        mine = range(self.start_sample + self.rank, size, self.num_replicas)
        yield from mine
        if self.start_sample < size and self.batch_shares()[-1][0] == 0:
            yield mine[-1] if mine else self.start_sample

    def __iter__(self) -> Iterator[int]:
        size, prefetcher = len(self.dataset), self.prefetcher
        if prefetcher is not None:
            prefetcher.begin((self.epoch, self.lanes, self.window, self.start_sample),
                             lambda: rank_plan(self.order(), self.start_sample, self.rank, self.num_replicas))
        for k, position in enumerate(self._positions()):
            if prefetcher is not None:
                prefetcher.dispatched(k)
            yield encode_key(self.epoch, self.lanes, self.window, position, size)

    def indices(self) -> list[int]:
        order = self.order()
        return [order.sample(position) for position in self._positions()]

    def epoch_order(self) -> list[int]:
        order = self.order()
        return [order.sample(position) for position in range(len(self.dataset))]

    def bytes_needed(self, lag_samples: int) -> int:
        """The most bytes this rank holds at once for the epoch about to start (shard sizes prorated)."""
        plan = rank_plan(self.order(), self.start_sample, self.rank, self.num_replicas)
        return bytes_open_at_once(plan, lag_samples, partial(_window_bytes, self.sharded.shards))

    def order_state(self) -> dict[str, int]:
        """The epoch in progress's order, for the checkpoint: a resume continues it whatever the world size."""
        return {"epoch": self.epoch, "lanes": self.lanes, "window": self.window}

    def restore_order_state(self, saved: dict[str, int] | None) -> None:
        self._saved = None if saved is None else {key: int(saved[key]) for key in ("epoch", "lanes", "window")}


class BlockSampler(torch.utils.data.Sampler[int]):
    """Evaluation over a sharded dataset: rank r reads one contiguous block of the samples (every sample on exactly
    one rank, no padding), so that it reads few shards, in order."""

    def __init__(self, dataset: ShardedDataset, num_replicas: int, rank: int) -> None:
        size = len(dataset)
        self.first, self.end = rank * size // num_replicas, (rank + 1) * size // num_replicas
        self.counts = dataset.counts
        self.shards = dataset.shards
        self.prefetcher: Prefetcher | None = None
        # Each evaluation is a plan of its own, counted when one is read to its end: the first-batch check's look at
        # the first keys and the first evaluation share one.
        self._rounds = 0

    def __iter__(self) -> Iterator[int]:
        prefetcher = self.prefetcher
        if prefetcher is not None:
            prefetcher.begin(("eval", self._rounds), self.plan)
        for k, sample in enumerate(range(self.first, self.end)):
            if prefetcher is not None:
                prefetcher.dispatched(k)
            yield sample
        self._rounds += 1

    def __len__(self) -> int:
        return self.end - self.first

    def plan(self) -> list[PlannedWindow]:
        """The block's shards, each a window read from its first sample here to its last."""
        return [window for window in rank_plan(ShardOrder(self.counts, 0, 0, 0, 1), self.first, 0, 1)
                if window.first < self.end - self.first]

    def bytes_needed(self, lag_samples: int) -> int:
        """The most bytes an evaluation holds at once: a shard is held from its first read until ``lag_samples``
        after its last (the workers read ahead), so small shards are held several at a time."""
        return bytes_open_at_once(self.plan(), lag_samples, partial(_window_bytes, self.shards))


def read_ahead_samples(batch_size: int, num_workers: int, prefetch_factor: int | None) -> int:
    """How far a DataLoader's workers may read past the index its sampler hands out: ``prefetch_factor`` batches
    per worker in flight, and two more (the batch being collated, the one the loop holds). A window is kept this
    long after its last index, and a cache bound is sized with it (trainer.data.shards.fetching, the figures)."""
    in_flight = (prefetch_factor or 2) * num_workers if num_workers else 0
    return (in_flight + 2) * batch_size


def _window_bytes(shards: list[ShardEntry], window: PlannedWindow) -> int:
    """A window's bytes from index.json alone: each piece its shard's bytes spread evenly over the shard's samples
    (a whole shard, as evaluation reads, is its bytes exactly)."""
    return sum(shards[piece.shard].bytes * piece.samples // shards[piece.shard].samples for piece in window.pieces)
