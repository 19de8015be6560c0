"""A sharded dataset: tar shards under one prefix, read by the byte range a rank trains, never copied whole.

``ShardedDataset`` is map-style (its length is the index's sample count, sample ``i`` is the i-th of the shards
in index order), so everything the trainer guarantees for map-style data holds for it: the order is the trainer's
global position (trainer.data.shards.order), and the trainer swaps in a sampler that keeps it local in shards.
A user's task declares one in ``datasets()``::

    from trainer.data.shards import ShardedDataset

    def datasets(self, context):
        return TaskData(train=ShardedDataset(self.options.data, "train", decode=my_decode),
                        eval=ShardedDataset(self.options.data, "eval", decode=my_decode))

``decode`` takes the sample's members (``{"jpg": b"...", "cls": b"3"}``, by extension) and returns the
``(inputs, targets)`` item. It runs in the DataLoader's workers and must be picklable (a module-level function
or an instance of a module-level class).
"""

from __future__ import annotations

import bisect
import copy
import logging
import os
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset, get_worker_info

from trainer.data.jpeg_bytes import with_origin
from trainer.data.locate import DEFAULT_CACHE, cache_folder
from trainer.data.shards.cache import PieceCache, claim_folder
from trainer.data.shards.layout import INDEX_NAME, DatasetIndex, ShardEntry
from trainer.data.shards.order import Piece, ShardOrder
from trainer.data.shards.store import RetryPolicy, ShardStore
from trainer.errors import DataError, described
from trainer.items import Fetched
from trainer.rng import isolated, seed_item
from trainer.sampler import SeededItems

__all__ = ["Members", "ShardedDataset", "ShardedItems", "decode_members"]

log = logging.getLogger(__name__)
Members = dict[str, bytes]


def _read_index(store: ShardStore) -> DatasetIndex:
    return DatasetIndex.from_json(store.read(INDEX_NAME), store.where(INDEX_NAME))


def decode_members(members: Members) -> Members:
    """The default decode: the sample's members as they are (a task's collate_fn makes batches of them)."""
    return members


class ShardedDataset(Dataset[Any]):
    """One split of a sharded dataset at ``url`` (a local folder or any fsspec URL). Opening it reads the index
    (one request) and lists the prefix (one request) to check that every shard is there at its listed size."""

    def __init__(self, url: str, split: str = "train", decode: Callable[[Members], Any] = decode_members,
                 retry: RetryPolicy | None = None) -> None:
        store = ShardStore(url, retry)
        self._open(store, _read_index(store), store.sizes(), split, decode)

    @classmethod
    def splits(cls, url: str, names: Sequence[str], decode: Callable[[Members], Any] = decode_members,
               retry: RetryPolicy | None = None) -> list[ShardedDataset]:
        """Several splits of one dataset (``["train", "eval"]``), opened with one read of the index and one listing
        between them: a job's start waits for two requests, not four."""
        store = ShardStore(url, retry)
        index, listed = _read_index(store), store.sizes()
        opened = []
        for name in names:
            dataset = cls.__new__(cls)
            dataset._open(store, index, listed, name, decode)
            opened.append(dataset)
        return opened

    def _open(self, store: ShardStore, index: DatasetIndex, listed: dict[str, int], split: str,
              decode: Callable[[Members], Any]) -> None:
        self.store = store
        self.split = split
        self.decode = decode
        self.shards: list[ShardEntry] = index.split(split, store.where(INDEX_NAME))
        self.info = index.info
        self._check_listing(listed)
        self._count(self.shards)
        self.cache: PieceCache | None = None
        self._owner: Any = None  # the cache folder's lock, held by the process that claimed it

    def _check_listing(self, listed: dict[str, int]) -> None:
        missing = [entry.name for entry in self.shards if entry.name not in listed]
        wrong = [f"{entry.name} ({listed[entry.name]} bytes, listed {entry.bytes})" for entry in self.shards
                 if entry.name in listed and listed[entry.name] != entry.bytes]
        no_index = [entry.sidecar for entry in self.shards if entry.sidecar not in listed]
        problems = []
        if missing:
            problems.append(f"{len(missing)} shard(s) it lists are missing ({', '.join(missing[:3])})")
        if wrong:
            problems.append(f"{len(wrong)} shard(s) differ in size from the index ({', '.join(wrong[:3])})")
        if no_index:
            problems.append(f"{len(no_index)} shard index file(s) are missing ({', '.join(no_index[:3])})")
        if problems:
            raise DataError(f"{self.store.where(INDEX_NAME)} does not match the shards beside it: "
                            f"{'; '.join(problems)}; upload the missing shards, or rebuild the index (ddp-shard "
                            f"index {self.store.shown})")

    def _count(self, shards: list[ShardEntry]) -> None:
        self.shards = shards
        self.counts = [entry.samples for entry in shards]
        self.starts = [0]
        for count in self.counts:
            self.starts.append(self.starts[-1] + count)
        self.size = self.starts[-1]

    def __len__(self) -> int:
        return self.size

    @property
    def mean_shard_samples(self) -> float:
        return self.size / len(self.shards)

    def head(self, count: int) -> ShardedDataset:
        """The first ``count`` samples: whole shards, the last one cut."""
        if count >= self.size:
            return self
        cut, shards, left = copy.copy(self), [], count
        for entry in self.shards:
            if left <= 0:
                break
            shards.append(replace(entry, samples=min(entry.samples, left)))
            left -= shards[-1].samples
        cut._count(shards)
        cut.cache = None
        return cut

    def attach_cache(self, parent: Path, name: str) -> Path:
        """Claim this process's cache folder ``parent/<dataset>/<name>`` (trainer.data.shards.cache.claim_folder)."""
        folder, self._owner = claim_folder(cache_folder(self.store.url, str(parent)), name)
        self.cache = PieceCache(folder, self.store, self.shards)
        return folder

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_owner": None}

    def _cache(self) -> PieceCache:
        if self.cache is None:  # used outside the trainer: a folder of its own in the default cache
            self.attach_cache(Path(DEFAULT_CACHE).expanduser() / "shards", f"{self.split}-pid{os.getpid()}")
        assert self.cache is not None
        return self.cache

    def __getitem__(self, sample: int) -> Any:
        """Sample ``sample`` by itself: its byte range alone is fetched (the trainer reads by pieces instead)."""
        order = ShardOrder(self.counts, 0, 0, 0, 1)
        return self.fetch(sample, order.piece_of(sample))

    def fetch_pieces(self, pieces: Collection[Piece]) -> None:
        """The pieces a batch reads that the cache lacks, fetched side by side (a batch draws from a window of
        every lane: one after another, the first batch of an epoch would wait for a round trip per lane)."""
        cache = self._cache()
        missing = [piece for piece in pieces if not cache.path(piece).exists()]
        if len(missing) < 2 or cache.fetch_threads < 2:
            return  # fetched one by one where they are read
        who = f"pid{os.getpid()}"
        with ThreadPoolExecutor(min(len(missing), cache.fetch_threads), thread_name_prefix="shard-fetch") as pool:
            for _ in pool.map(lambda piece: cache.ensure(piece, who), missing):
                pass  # the first failure is raised here, as the sample's own read would raise it

    def fetch(self, sample: int, piece: Piece) -> Any:
        cache = self._cache()
        shard = bisect.bisect_right(self.starts, sample) - 1
        index_in_shard = sample - self.starts[shard]
        key, members = cache.read_sample(piece, index_in_shard, f"pid{os.getpid()}")
        try:
            return with_origin(self.decode(members), f"{self.store.where(self.shards[shard].name)}: sample {key}")
        except DataError as error:
            raise DataError(f"{self.store.where(self.shards[shard].name)}: sample {key}: {error}") from None
        except Exception as error:  # noqa: BLE001 - a user's decode: one line that names the sample, not a traceback
            raise DataError(f"{self.store.where(self.shards[shard].name)}: sample {key}: decode "
                            f"({getattr(self.decode, '__qualname__', type(self.decode).__name__)}) raised "
                            f"{described(error)}") from None


# A key packs the order's parameters with the position, so that a DataLoader worker (a process that lives across
# epochs) needs nothing from the main process but the key to find a sample and the piece it is in.
_LANE_SLOTS = 1 << 12
_WINDOW_SLOTS = 1 << 40


def encode_key(epoch: int, lanes: int, window: int, position: int, size: int) -> int:
    return ((epoch * _LANE_SLOTS + lanes) * _WINDOW_SLOTS + window) * size + position


def decode_key(key: int, size: int) -> tuple[int, int, int, int]:
    rest, position = divmod(key, size)
    rest, window = divmod(rest, _WINDOW_SLOTS)
    epoch, lanes = divmod(rest, _LANE_SLOTS)
    return epoch, lanes, window, position


class ShardedItems(SeededItems):
    """SeededItems for a sharded dataset: a key is (epoch, the epoch's lanes and window, position), decoded into the
    sample at that position and the piece that holds it; a plain sample id (lanes 0) reads in index order."""

    def __init__(self, dataset: ShardedDataset, seed: int, deterministic: bool, epoch_offset: int = 0) -> None:
        super().__init__(dataset, seed, deterministic, epoch_offset)
        self.sharded = dataset
        self._batched = None
        self._orders: dict[tuple[int, int, int], ShardOrder] = {}

    def order(self, epoch: int, lanes: int, window: int) -> ShardOrder:
        found = self._orders.get((epoch, lanes, window))
        if found is None:
            if len(self._orders) > 2:
                self._orders.clear()
            found = self._orders[(epoch, lanes, window)] = ShardOrder(self.sharded.counts, self.seed, epoch, lanes,
                                                                      max(1, window) if lanes else window)
        return found

    def locate(self, key: int) -> tuple[int, int, Piece]:
        """(epoch, sample id, the piece to read it from)."""
        epoch, lanes, window, position = decode_key(key, self.size)
        order = self.order(epoch, lanes, window)
        return epoch, order.sample(position), order.piece_of(position)

    def index(self, key: int) -> int:
        return self.locate(key)[1]

    def probe_key(self) -> int:
        """Sample 0 read by itself (one sample's byte range, not its shard): a look at the data before training."""
        return encode_key(0, 0, 1, 0, self.size)

    def __getitem__(self, key: int) -> Any:
        return self._item(*self.locate(key))

    def _item(self, epoch: int, sample: int, piece: Piece) -> Any:
        if self.deterministic:
            return self.sharded.fetch(sample, piece)
        with isolated() if get_worker_info() is None else nullcontext():
            seed_item(self.seed, epoch + self.epoch_offset, sample)
            return self.sharded.fetch(sample, piece)

    def __getitems__(self, keys: list[int]) -> Any:
        located = [self.locate(key) for key in keys]
        self.sharded.fetch_pieces({piece for _, _, piece in located})
        return Fetched([self._item(*where) for where in located], [sample for _, sample, _ in located])
