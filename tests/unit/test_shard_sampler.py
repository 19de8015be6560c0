"""The sampler over a sharded dataset and the prefetcher behind it, in one process over a local folder: the epoch's
order survives a resume at another world size (its lanes saved), the next epoch takes its own; a placeholder step
reads the rank's own last sample; the cache bound is checked against the epoch about to start; and reading an
epoch through a DataLoader keeps the cache within its bound and leaves nothing behind."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.support.ledger import decode_ledger, write_ledger_shards
from trainer.data.shards import ShardedDataset, ShardedItems
from trainer.data.shards.fetching import _check_training_bound
from trainer.data.shards.prefetch import Prefetcher
from trainer.data.shards.sampler import BlockSampler, CacheBound, OrderSettings, ShardedDistributedSampler
from trainer.errors import DataError


@pytest.fixture
def shards(tmp_path: Path) -> str:
    url = str(tmp_path / "data")
    write_ledger_shards(url, 145, (7, 11, 5, 9))
    return url


def sampler(url: str, world_size: int, rank: int, batch: int = 4, lanes: int = 0) -> ShardedDistributedSampler:
    return ShardedDistributedSampler(ShardedDataset(url, "train", decode_ledger), world_size, rank, seed=0,
                                     batch_size=batch, settings=OrderSettings(lanes, 1.0))


def test_a_resumed_epoch_keeps_its_lanes_at_another_world_size_and_the_next_takes_its_own(shards):
    first = sampler(shards, 2, 0, lanes=0)
    first.set_epoch(0)
    saved = first.order_state()
    assert saved["lanes"] == 12
    resumed = sampler(shards, 5, 0)
    resumed.restore_order_state(saved)
    resumed.set_epoch(0, start_sample=40)
    assert resumed.lanes == 12 and resumed.order().sample(40) == first.order().sample(40)
    resumed.set_epoch(1)
    assert resumed.lanes == 15


def test_a_placeholder_step_reads_the_ranks_own_last_sample(shards):
    """145 samples at 3 ranks of 4: the last global batch holds 1 sample, so ranks 1 and 2 step on a placeholder."""
    for rank in range(3):
        dealt = sampler(shards, 3, rank)
        dealt.set_epoch(0)
        positions = list(dealt._positions())
        own = list(range(rank, 145, 3))
        assert positions[:len(own)] == own
        assert positions[len(own):] == ([] if rank == 0 else [own[-1]])


def test_the_bound_is_checked_against_the_epoch_about_to_start(shards, tmp_path):
    """At 5 ranks a fresh epoch has 15 lanes, 3 a rank; an epoch begun at 2 ranks (12 lanes) and resumed at 5 has
    each rank read all 12: a bound that fits the first is refused for the second, before its first step."""
    resumed = sampler(shards, 5, 0)
    resumed.sharded.attach_cache(tmp_path / "cache", "train-rank0")
    assert resumed.sharded.cache is not None
    resumed.set_epoch(0)
    lag = 8
    resumed.prefetcher = Prefetcher(resumed.sharded.cache, resumed.bytes_needed(lag), lag, "rank0")
    resumed.bound = CacheBound(0.00001, 0, 1)
    _check_training_bound(resumed)
    begun = sampler(shards, 2, 0)
    begun.set_epoch(0)
    resumed.restore_order_state(begun.order_state())
    resumed.set_epoch(0, start_sample=40)
    # Both sides round to 0.1 MB: shown in bytes instead, so that the refusal never reads "0.1 MB, more than 0.1 MB".
    with pytest.raises(DataError, match=r"--shard-cache-gb 1e-05: rank 0 needs [\d,]+ bytes of shards open at once "
                                        r"in epoch 1 \(12 lanes over 5 rank\(s\), windows of 8 samples\), more than "
                                        r"the [\d,]+ bytes it trains with"):
        _check_training_bound(resumed)


@pytest.mark.parametrize(("reader", "thread"), [("train", "prompt"), ("train", "slow"), ("train", "failing"),
                                              ("eval", "slow")])
def test_an_epoch_read_through_workers_stays_within_the_bound_and_leaves_nothing(tmp_path, monkeypatch, reader,
                                                                                  thread):
    """600 samples in shards of 10, read by 2 workers: in training 2 lanes, in evaluation (a block of whole shards)
    the shards held until the workers are past them; the bound is what the sampler says it needs, a tenth of the
    data. Whatever the prefetch thread does (prompt; 50 ms late with every window, as on a loaded machine, so the
    workers fetch most windows themselves; failing with an unexpected error now and then), the cache stays within
    the bound."""
    if thread == "slow":
        fetch = Prefetcher._fetch
        monkeypatch.setattr(Prefetcher, "_fetch", lambda self, window: time.sleep(0.05) or fetch(self, window))
    elif thread == "failing":
        size, calls = Prefetcher._size, [0]

        def sometimes(self: Prefetcher, window: object) -> object:
            calls[0] += 1
            if calls[0] % 3 == 0:
                raise KeyError(calls[0])
            return size(self, window)

        monkeypatch.setattr(Prefetcher, "_size", sometimes)
    url = str(tmp_path / "long")
    write_ledger_shards(url, 600, (10,))
    dealt: ShardedDistributedSampler | BlockSampler
    if reader == "train":
        dealt = sampler(url, 1, 0, batch=5, lanes=2)
        dealt.set_epoch(0)
    else:
        dealt = BlockSampler(ShardedDataset(url, "train", decode_ledger), 1, 0)
    dataset = dealt.sharded if isinstance(dealt, ShardedDistributedSampler) else ShardedDataset(url, "train",
                                                                                              decode_ledger)
    folder = dataset.attach_cache(tmp_path / "cache", f"{reader}-rank0")
    assert dataset.cache is not None
    lag = (2 * 2 + 2) * 5
    bound = dealt.bytes_needed(lag)
    dealt.prefetcher = Prefetcher(dataset.cache, bound, lag, "rank0")
    loader = DataLoader(ShardedItems(dataset, 0, True), batch_size=5, sampler=dealt, num_workers=2,
                        collate_fn=lambda items: torch.stack([item[0] for item in items]))
    try:
        with cache_peak(folder) as peak:
            seen = torch.cat(list(loader)).tolist()
    finally:
        dealt.prefetcher.stop()
    assert sorted(seen) == list(range(600))
    assert 0 < peak[0] <= bound, (peak[0], bound)
    assert bound < 0.15 * sum(entry.bytes for entry in dataset.shards)
    # Each piece fetched once, however many threads fetch (windows here are whole shards)
    fetches = [tuple(line.split()[1:4]) for line in (folder / "fetched.log").read_text().splitlines()]
    pieces = [fetch for fetch in fetches if fetch[1] != "-1"]
    assert len(pieces) == len(set(pieces)) == 60, sorted(fetches)
    assert sorted(path.name for path in folder.iterdir()) == [".owner.lock", "fetched.log"]


@contextlib.contextmanager
def cache_peak(folder: Path) -> Iterator[list[int]]:
    """The most bytes of pieces in ``folder`` at once, polled every 2 ms by a thread; an error in it fails the test."""
    peak, errors, stop = [0], [], threading.Event()

    def size(path: Path) -> int:
        try:
            return path.stat().st_size
        except FileNotFoundError:  # evicted between the listing and the stat
            return 0

    def watch() -> None:
        try:
            while not stop.is_set():
                peak[0] = max(peak[0], sum(size(path) for path in folder.glob("*.piece")))
                time.sleep(0.002)
        except BaseException as error:  # noqa: BLE001 - handed to the test below
            errors.append(error)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield peak
    finally:
        stop.set()
        watcher.join()
    assert not errors, f"the cache watcher failed: {errors[0]!r}"


def test_splits_open_with_one_read_of_the_index_and_one_listing(shards, monkeypatch):
    from trainer.data.shards.store import ShardStore

    calls: list[str] = []
    read, sizes = ShardStore.read, ShardStore.sizes
    monkeypatch.setattr(ShardStore, "read", lambda self, name, *rest: calls.append(name) or read(self, name, *rest))
    monkeypatch.setattr(ShardStore, "sizes", lambda self: calls.append("(listing)") or sizes(self))
    train, evaluation = ShardedDataset.splits(shards, ["train", "eval"], decode_ledger)
    assert calls == ["index.json", "(listing)"]
    assert (len(train), len(evaluation)) == (145, 8) and train.decode is evaluation.decode is decode_ledger
    assert train.shards == ShardedDataset(shards, "train").shards and evaluation.split == "eval"
