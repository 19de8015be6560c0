"""Wiring a run's sharded datasets to their node-local caches and prefetchers (called once by trainer.build).

The node's bound (--shard-cache-gb) is shared equally by its ranks. Of a rank's share, evaluation takes what its
reads need at most (whole shards, held until the DataLoader's workers are past them: known from the evaluation
set's shard sizes alone), and training the rest. A bound too small for either is refused before the first step,
on every rank alike; training's need is checked again as each epoch starts (its lanes may change).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainer.data.locate import DEFAULT_CACHE
from trainer.data.shards.cache import MAX_FETCH_THREADS
from trainer.data.shards.dataset import ShardedItems
from trainer.data.shards.prefetch import Prefetcher
from trainer.data.shards.sampler import BlockSampler, CacheBound, ShardedDistributedSampler, read_ahead_samples
from trainer.data.shards.store import RetryPolicy
from trainer.distributed import Runtime, agreed
from trainer.errors import DataError

__all__ = ["check_epoch_bound", "start_fetching", "stop_fetching"]


def start_fetching(settings: Any, runtime: Runtime, train_loader: DataLoader[Any], eval_loader: DataLoader[Any]
                   ) -> None:
    """``settings``: the run's DataConfig (its --shard-* values)."""
    loaders = [(role, loader) for role, loader in (("train", train_loader), ("eval", eval_loader))
               if isinstance(loader.dataset, ShardedItems)]
    if not loaders:
        return
    identity = runtime.identity
    share = int(settings.shard_cache_gb * 1e9 / max(1, identity.local_world_size))
    parent = Path(settings.shard_cache_dir or Path(DEFAULT_CACHE) / "shards").expanduser()
    fetch_threads = max(1, min(MAX_FETCH_THREADS, torch.get_num_threads()))  # the rank's share of the cores

    def attach() -> None:
        evaluation = 0  # what evaluation holds at most; training gets the rest of the share
        for role, loader in sorted(loaders, key=lambda pair: pair[0] != "eval"):  # evaluation's need first
            items = loader.dataset
            assert isinstance(items, ShardedItems)
            dataset = items.sharded
            dataset.store.retry = RetryPolicy(attempts=settings.shard_retries)
            dataset.attach_cache(parent, f"{role}-rank{identity.local_rank}")
            assert dataset.cache is not None and loader.batch_size is not None
            dataset.cache.fetch_threads = fetch_threads
            lag = read_ahead_samples(loader.batch_size, loader.num_workers, loader.prefetch_factor)
            sampler = loader.sampler
            assert isinstance(sampler, ShardedDistributedSampler | BlockSampler)
            if isinstance(sampler, BlockSampler):
                evaluation = sampler.bytes_needed(lag)
                if evaluation > share:
                    needed, available = _sizes(evaluation, share)
                    raise DataError(
                        f"--shard-cache-gb {settings.shard_cache_gb:g}: rank {identity.rank} needs "
                        f"{needed} of evaluation shards open at once (whole shards, each held until its "
                        f"DataLoader workers are {lag} samples past it), more than its {available} share of the "
                        f"node's bound ({identity.local_world_size} rank(s)); raise --shard-cache-gb, write smaller "
                        f"shards, or lower --eval-batch-size or --num-workers")
                sampler.prefetcher = Prefetcher(dataset.cache, evaluation, lag, f"rank{identity.rank}")
            else:
                sampler.prefetcher = Prefetcher(dataset.cache, share - evaluation, lag, f"rank{identity.rank}")
                sampler.bound = CacheBound(settings.shard_cache_gb, identity.rank, identity.local_world_size,
                                           evaluation)
                _check_training_bound(sampler)

    agreed(runtime, attach, DataError, long_work="the sharded datasets' caches")


def check_epoch_bound(loader: DataLoader[Any], runtime: Runtime) -> None:
    """The bound against the epoch about to start, on every rank alike: a resumed epoch keeps the lanes it began
    with (another world size may read more of them per rank), and each epoch permutes the shards anew."""
    sampler = loader.sampler
    if isinstance(sampler, ShardedDistributedSampler) and sampler.bound is not None:
        agreed(runtime, lambda: _check_training_bound(sampler), DataError)


def _check_training_bound(sampler: ShardedDistributedSampler) -> None:
    prefetcher, bound = sampler.prefetcher, sampler.bound
    assert prefetcher is not None and bound is not None
    needed = sampler.bytes_needed(prefetcher.lag_samples)
    if needed > prefetcher.bound_bytes:
        shown_needed, shown_bound = _sizes(needed, prefetcher.bound_bytes)
        evaluation = f", less the {_size(bound.evaluation_bytes)} evaluation holds" if bound.evaluation_bytes else ""
        smaller_evaluation = ", --eval-batch-size or --num-workers" if bound.evaluation_bytes else ""
        raise DataError(
            f"--shard-cache-gb {bound.flag_gb:g}: rank {bound.rank} needs {shown_needed} of shards open at once in "
            f"epoch {sampler.epoch + 1} ({sampler.lanes} lanes over {sampler.num_replicas} rank(s), windows of "
            f"{sampler.window} samples), more than the {shown_bound} it trains with (its share of the node's bound "
            f"over {bound.local_world_size} rank(s){evaluation}); raise --shard-cache-gb, or lower --shard-window, "
            f"--shard-lanes{smaller_evaluation}")


def _size(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


def _sizes(needed: int, available: int) -> tuple[str, str]:
    """The two sides of a refusal, in bytes where rounding would print them alike."""
    shown = _size(needed), _size(available)
    return shown if shown[0] != shown[1] else (f"{needed:,} bytes", f"{available:,} bytes")


def stop_fetching(*loaders: DataLoader[Any]) -> None:
    """Stop the loaders' prefetchers (their pieces are deleted); a loader over other data is left as it is."""
    for loader in loaders:
        prefetcher = getattr(loader.sampler, "prefetcher", None)
        if isinstance(prefetcher, Prefetcher):
            prefetcher.stop()
