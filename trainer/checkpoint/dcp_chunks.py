"""A tensor's chunks as DCP's metadata lists them, checked before any rank reads one: each lies inside the tensor
and has its place in a file, and together they cover the tensor exactly once (a hostile metadata could have every
rank read one chunk a million times, or leave rows of memory unread)."""

from __future__ import annotations

import bisect
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from trainer.checkpoint.reading import DCP_METADATA, InvalidCheckpoint

__all__ = ["MAX_CHUNKS", "check_chunks"]

# The chunks of one tensor this trainer reads at most: one per rank that wrote it (the overlap check compares a
# chunk with those open beside it in a sweep: few for any sharding, most of the others for a layout made to defeat
# it).
MAX_CHUNKS = 4096


def check_chunks(key: str, value: TensorStorageMetadata, storage_data: dict[Any, Any]) -> None:
    """A tensor's chunks inside it, none twice, none overlapping, covering it exactly, each with its place in a
    file (a hostile metadata could have every rank read one chunk a million times, or leave rows unread)."""
    size, chunks = [int(dim) for dim in value.size], list(value.chunks)
    if len(chunks) > MAX_CHUNKS:
        raise InvalidCheckpoint(f"{DCP_METADATA}: {key} is in {len(chunks)} chunks, more than this trainer reads "
                                f"({MAX_CHUNKS})")
    boxes = []
    for chunk in chunks:
        offsets, sizes = [int(dim) for dim in chunk.offsets], [int(dim) for dim in chunk.sizes]
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                low < 0 or extent < 0 or low + extent > whole for low, extent, whole in zip(offsets, sizes, size,
                                                                                            strict=True)):
            raise InvalidCheckpoint(f"{DCP_METADATA}: a chunk of {key} lies outside its shape {size}")
        if MetadataIndex(key, torch.Size(offsets)) not in storage_data:
            raise InvalidCheckpoint(f"{DCP_METADATA}: a chunk of {key} has no place in any file")
        boxes.append((offsets, sizes))
    if sum(math.prod(sizes) for _, sizes in boxes) != math.prod(size):
        raise InvalidCheckpoint(f"{DCP_METADATA}: the chunks of {key} do not cover it exactly once")
    # Equal volumes and no two chunks overlapping: each element exactly once (a 0-d tensor: one chunk, by volume).
    if not size:
        return
    if all(offsets[1:] == [0] * (len(size) - 1) and sizes[1:] == size[1:] for offsets, sizes in boxes):
        boxes = [([offsets[0]], [sizes[0]]) for offsets, sizes in boxes]  # row slabs (FSDP's): by their rows alone
    if _overlapping(boxes):
        raise InvalidCheckpoint(f"{DCP_METADATA}: chunks of {key} overlap")


def _overlapping(boxes: list[tuple[list[int], list[int]]]) -> bool:
    """Whether two chunks share an element. A sweep: the chunks in the order they start along one dimension, each
    compared only with those still open where it starts (reaching past its start), not with every other one: none
    for row slabs, at most 7 for a grid of 64 x 8. The dimension is the one where that makes the fewest pairs."""
    solid = [box for box in boxes if math.prod(box[1])]  # an empty chunk holds no element to share
    if len(solid) < 2:
        return False
    dim = min(range(len(solid[0][0])), key=lambda candidate: _pairs_compared(solid, candidate))
    solid.sort(key=lambda box: box[0][dim])
    open_ends: list[tuple[int, int]] = []  # (where a chunk ends along dim, its number), by end
    for number, (offsets, sizes) in enumerate(solid):
        start = offsets[dim]
        del open_ends[:bisect.bisect_right(open_ends, (start, len(solid)))]  # those that end at or before it
        for _, other in open_ends:
            other_offsets, other_sizes = solid[other]
            if all(low < other_low + other_extent and other_low < low + extent for low, extent, other_low, other_extent
                   in zip(offsets, sizes, other_offsets, other_sizes, strict=True)):
                return True
        bisect.insort(open_ends, (start + sizes[dim], number))
    return False


def _pairs_compared(boxes: list[tuple[list[int], list[int]]], dim: int) -> int:
    """How many pairs a sweep along ``dim`` compares at most: for each chunk, the chunks open where it starts."""
    # At one coordinate, a chunk that ends there closes before one that starts there opens: the two only touch.
    events = sorted([(offsets[dim] + sizes[dim], -1) for offsets, sizes in boxes] +
                    [(offsets[dim], 1) for offsets, _ in boxes])
    pairs = crossing = 0
    for _, change in events:
        if change > 0:
            pairs += crossing
        crossing += change
    return pairs
