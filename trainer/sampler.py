"""Which samples each rank sees: one global order per epoch, resumable at any global position.

Global batch ``b`` is the slice ``perm[b*W*B:(b+1)*W*B]`` of the epoch's permutation, dealt
round-robin to the W ranks. The position inside an epoch is therefore one number, the count
of samples consumed by all ranks together, and it means the same thing for any world size:
a job resumed with more or fewer ranks continues at the same place of the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler whose epoch can start at a global sample position.

    As in DistributedSampler, ``set_epoch`` must be called every epoch (the trainer does):
    the permutation is seeded by ``seed + epoch``, so every rank agrees on it and every
    epoch differs. The remainder is padded by repeating its first samples so that every
    rank gets the same number of batches (uneven counts would hang the collectives).
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.start_sample = 0
        self._refresh_sizes()

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        if not 0 <= start_sample <= len(self.dataset):
            raise ValueError(f"start_sample {start_sample} outside 0..{len(self.dataset)}")
        super().set_epoch(epoch)
        self.start_sample = start_sample
        self._refresh_sizes()

    def _refresh_sizes(self) -> None:
        remaining = len(self.dataset) - self.start_sample
        self.num_samples = math.ceil(remaining / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def epoch_order(self) -> list[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        remaining = self.epoch_order()[self.start_sample:]
        if not remaining:
            return iter([])
        padding = self.total_size - len(remaining)
        padded = remaining + (remaining * math.ceil(padding / len(remaining)))[:padding]
        return iter(padded[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class ShardSampler(torch.utils.data.Sampler[int]):
    """Evaluation shard: rank r takes samples r, r+W, ... with no padding, so every sample counts once.

    Ranks may get different numbers of batches; evaluation therefore runs no collective inside
    its loop and reduces the totals once at the end.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int) -> None:
        self.size = len(dataset)
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.size, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.num_replicas))
