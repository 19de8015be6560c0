"""Sharded datasets: WebDataset tar shards with an index, streamed from any fsspec URL by the byte ranges each rank
trains, in a global order that keeps every sample once per epoch through resumes and resizes (docs/data.md)."""

from trainer.data.shards.dataset import Members, ShardedDataset, ShardedItems, decode_members
from trainer.data.shards.layout import DatasetIndex, ShardEntry, ShardIndex
from trainer.data.shards.order import ShardOrder, auto_lanes
from trainer.data.shards.prefetch import PlannedWindow, rank_plan
from trainer.data.shards.sampler import BlockSampler, OrderSettings, ShardedDistributedSampler, read_ahead_samples
from trainer.data.shards.store import RetryPolicy

__all__ = ["BlockSampler", "DatasetIndex", "Members", "OrderSettings", "PlannedWindow", "RetryPolicy", "ShardEntry",
           "ShardIndex", "ShardOrder", "ShardedDataset", "ShardedDistributedSampler", "ShardedItems", "auto_lanes",
           "decode_members", "rank_plan", "read_ahead_samples"]
