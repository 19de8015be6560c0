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
from trainer.data.shards.sampler import BlockSampler, ShardedDistributedSampler
from trainer.data.shards.store import RetryPolicy
from trainer.distributed import Runtime, agreed
from trainer.errors import DataError

__all__ = ["start_fetching", "stop_fetching"]

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
            if isinstance(sampler, ShardedDistributedSampler):
                needed = sampler.bytes_needed(lag)
                if needed > bound:
                    raise DataError(
                        f"--shard-cache-gb {settings.shard_cache_gb:g}: rank {identity.rank} needs {needed / 1e9:.3f} "
                        f"GB of shards open at once ({sampler.lanes} lanes over {sampler.num_replicas} rank(s), "
                        f"windows of {sampler.window} samples), more than the {bound / 1e9:.3f} GB of the bound it "
                        f"trains with ({TRAINING_SHARE:.0%} of the node's bound over its "
                        f"{identity.local_world_size} rank(s)); raise --shard-cache-gb, or lower --shard-window or "
                        f"--shard-lanes")
            else:
                largest = max(entry.bytes for entry in dataset.shards)
                if largest > bound:
                    raise DataError(f"--shard-cache-gb {settings.shard_cache_gb:g}: the evaluation set's largest shard "
                                    f"({largest / 1e9:.3f} GB) does not fit the {bound / 1e9:.3f} GB this rank "
                                    f"evaluates with; raise --shard-cache-gb or write smaller shards")
            assert isinstance(sampler, ShardedDistributedSampler | BlockSampler)
            sampler.prefetcher = Prefetcher(dataset.cache, bound, lag, f"rank{identity.rank}")

    agreed(runtime, attach, DataError, long_work="the sharded datasets' caches")


def stop_fetching(*loaders: DataLoader[Any]) -> None:
    """Stop the loaders' prefetchers (their pieces are deleted); a loader over other data is left as it is."""
    for loader in loaders:
        prefetcher = getattr(loader.sampler, "prefetcher", None)
        if isinstance(prefetcher, Prefetcher):
            prefetcher.stop()
