"""Wiring a run's sharded datasets to their node-local caches and prefetchers (called once by trainer.build).

The node's bound (--shard-cache-gb) is shared by its ranks; each rank gives three quarters of its share to training
and a quarter to evaluation, which holds one shard's worth at a time. A bound too small for the lanes a rank reads
side by side is refused before the first step, on every rank alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from trainer.data.locate import DEFAULT_CACHE
from trainer.data.shards.dataset import ShardedItems
from trainer.data.shards.prefetch import Prefetcher
from trainer.data.shards.sampler import BlockSampler, CacheBound, ShardedDistributedSampler
from trainer.data.shards.store import RetryPolicy
from trainer.distributed import Runtime, agreed
from trainer.errors import DataError

__all__ = ["check_epoch_bound", "start_fetching", "stop_fetching"]

TRAINING_SHARE = 0.75


def start_fetching(settings: Any, runtime: Runtime, train_loader: DataLoader[Any], eval_loader: DataLoader[Any]
                   ) -> None:
    """``settings``: the run's DataConfig (its --shard-* values)."""
    loaders = [(role, loader) for role, loader in (("train", train_loader), ("eval", eval_loader))
               if isinstance(loader.dataset, ShardedItems)]
    if not loaders:
        return
    identity = runtime.identity
    share = settings.shard_cache_gb * 1e9 / max(1, identity.local_world_size)
    parent = Path(settings.shard_cache_dir or Path(DEFAULT_CACHE) / "shards").expanduser()

    def attach() -> None:
        for role, loader in loaders:
            items = loader.dataset
            assert isinstance(items, ShardedItems)
            dataset = items.sharded
            dataset.store.retry = RetryPolicy(attempts=settings.shard_retries)
            dataset.attach_cache(parent, f"{role}-rank{identity.local_rank}")
            assert dataset.cache is not None and loader.batch_size is not None
            in_flight = (loader.prefetch_factor or 2) * loader.num_workers if loader.num_workers else 0
            lag = (in_flight + 2) * loader.batch_size
            sampler = loader.sampler
            bound = int(share * (TRAINING_SHARE if role == "train" else 1 - TRAINING_SHARE))
            assert isinstance(sampler, ShardedDistributedSampler | BlockSampler)
            sampler.prefetcher = Prefetcher(dataset.cache, bound, lag, f"rank{identity.rank}")
            if isinstance(sampler, ShardedDistributedSampler):
                sampler.bound = CacheBound(settings.shard_cache_gb, identity.rank, identity.local_world_size)
                _check_training_bound(sampler)
            else:
                largest = max(entry.bytes for entry in dataset.shards)
                if largest > bound:
                    raise DataError(f"--shard-cache-gb {settings.shard_cache_gb:g}: the evaluation set's largest shard "
                                    f"({_size(largest)}) does not fit the {_size(bound)} this rank evaluates with; "
                                    f"raise --shard-cache-gb or write smaller shards")

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
        raise DataError(
            f"--shard-cache-gb {bound.flag_gb:g}: rank {bound.rank} needs {_size(needed)} of shards open at once in "
            f"epoch {sampler.epoch + 1} ({sampler.lanes} lanes over {sampler.num_replicas} rank(s), windows of "
            f"{sampler.window} samples), more than the {_size(prefetcher.bound_bytes)} it trains with "
            f"({TRAINING_SHARE:.0%} of the node's bound over its {bound.local_world_size} rank(s)); raise "
            f"--shard-cache-gb, or lower --shard-window or --shard-lanes")


def _size(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


def stop_fetching(*loaders: DataLoader[Any]) -> None:
    """Stop the loaders' prefetchers (their pieces are deleted); a loader over other data is left as it is."""
    for loader in loaders:
        prefetcher = getattr(loader.sampler, "prefetcher", None)
        if isinstance(prefetcher, Prefetcher):
            prefetcher.stop()
