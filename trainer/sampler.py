"""Which samples each rank sees: one global order per epoch, resumable at any global position.

Global batch ``b`` is the slice ``perm[b*W*B:(b+1)*W*B]`` of the epoch's permutation, dealt
round-robin to the W ranks. The position inside an epoch is therefore one number, the count
of samples consumed by all ranks together, and it means the same thing for any world size:
a job resumed with more or fewer ranks continues at the same place of the same order.

The samplers yield keys, not indices: ``epoch * len(dataset) + index``. ``SeededItems`` decodes a key
and seeds the random generators from (seed, epoch, index) before fetching the item, so an item's
random transforms are the same whichever rank or DataLoader worker fetches it, and a resumed or
resized run sees exactly the items an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler, get_worker_info

from trainer.items import Fetched
from trainer.rng import isolated, seed_item

__all__ = ["ResumableDistributedSampler", "SeededItems", "ShardSampler"]

EVAL_EPOCH = -1  # the evaluation set's items are seeded as an epoch of their own


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler whose epoch can start at a global sample position, and which never repeats a sample.

    As in DistributedSampler, ``set_epoch`` must be called every epoch (the trainer does):
    the permutation is seeded by ``seed + epoch``, so every rank agrees on it and every
    epoch differs. Global batches hold ``world_size * batch_size`` samples; the epoch's last one may hold
    fewer, dealt round-robin like the others, so ranks end with uneven shares and none is repeated. A rank
    left with nothing in that last batch gets one placeholder item (the remainder's first sample) so that
    every rank runs the same number of steps and the collectives stay aligned; ``batch_shares`` says which
    of this rank's batches count how many samples, and the trainer gives the placeholder a weight of zero.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int, seed: int, batch_size: int = 1) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.start_sample = 0
        self._refresh_sizes()

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        if not 0 <= start_sample <= len(self.dataset):
            raise ValueError(f"start_sample {start_sample} outside 0..{len(self.dataset)}")
        super().set_epoch(epoch)
        self.start_sample = start_sample
        self._refresh_sizes()

    def _refresh_sizes(self) -> None:
        shares = self.batch_shares()
        self.num_samples = sum(max(mine, 1) for mine, _ in shares)  # a share of 0 steps on one placeholder
        self.total_size = len(self.dataset) - self.start_sample

    def batch_shares(self) -> list[tuple[int, int]]:
        """For each of this rank's batches this epoch, from the start sample on: (the real samples it holds,
        the real samples of its global batch across all ranks). The same number of batches on every rank;
        a share of 0 is a placeholder batch."""
        remaining = len(self.dataset) - self.start_sample
        per_global = self.num_replicas * self.batch_size
        shares = []
        for first in range(0, remaining, per_global):
            size = min(per_global, remaining - first)
            shares.append((len(range(self.rank, size, self.num_replicas)), size))
        return shares

    def epoch_order(self) -> list[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        remaining = self.epoch_order()[self.start_sample:]
        if not remaining:
            return iter([])
        mine = remaining[self.rank::self.num_replicas]
        shares = self.batch_shares()
        if shares[-1][0] == 0:  # nothing of the last global batch is this rank's: a placeholder to step with
            mine.append(remaining[0])
        offset = self.epoch * len(self.dataset)
        return iter([offset + index for index in mine])

    def indices(self) -> list[int]:
        """This rank's dataset indices this epoch, in the order it trains them (the sample log's record)."""
        return [key % len(self.dataset) for key in self]

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


class SeededItems(Dataset[Any]):
    """A dataset fetched by key (see the module's docstring), each item under its own seed.

    ``deterministic``: the items draw no random numbers, so seeding is skipped (keys are still decoded).
    In the main process (no DataLoader workers) the generators are restored after each item, so items
    do not consume the model's random stream (dropout).
    """

    def __init__(self, dataset: Dataset[Any], seed: int, deterministic: bool, epoch_offset: int = 0) -> None:
        self.dataset = dataset
        self.seed = seed
        self.deterministic = deterministic
        self.size = len(dataset)  # type: ignore[arg-type]
        self.epoch_offset = epoch_offset
        getitems = getattr(dataset, "__getitems__", None)
        self._batched: Callable[[list[int]], Any] | None = getitems if deterministic else None

    def __len__(self) -> int:
        return self.size

    def index(self, key: int) -> int:
        return key % self.size

    def probe_key(self) -> int:
        """A key to look at the data with before training (the first sample)."""
        return 0

    def __getitem__(self, key: int) -> Any:
        epoch, index = divmod(key, self.size)
        if self.deterministic:
            return self.dataset[index]
        if get_worker_info() is None:
            with isolated():
                seed_item(self.seed, epoch + self.epoch_offset, index)
                return self.dataset[index]
        seed_item(self.seed, epoch + self.epoch_offset, index)
        return self.dataset[index]

    def __getitems__(self, keys: list[int]) -> Any:
        if self._batched is not None:  # a batch at a time (ImageTensorDataset): one lookup, not one per item
            return self._batched([key % self.size for key in keys])
        return Fetched([self[key] for key in keys], [key % self.size for key in keys])
