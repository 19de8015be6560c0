"""A tensor's chunks as DCP's metadata lists them, checked before any rank reads one: each lies inside the tensor
and has its place in a file, and together they cover the tensor exactly once (a hostile metadata could have every
rank read one chunk a million times, or leave rows of memory unread)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from trainer.checkpoint.reading import DCP_METADATA, InvalidCheckpoint

__all__ = ["MAX_CHUNKS", "check_chunks"]

# The chunks of one tensor this trainer reads at most: one per rank that wrote it (a pairwise check of chunks
# that are not row slabs, TorchTitan's tensor-parallel ones, costs their square).
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
        rows = sorted((offsets[0], sizes[0]) for offsets, sizes in boxes if sizes[0])
        if any(first + count > following for (first, count), (following, _) in zip(rows, rows[1:], strict=False)):
            raise InvalidCheckpoint(f"{DCP_METADATA}: chunks of {key} overlap")
        return
    for number, (offsets, sizes) in enumerate(boxes):
        for other, other_sizes in boxes[number + 1:]:
            if all(min(a + n, b + m) > max(a, b) for a, n, b, m in zip(offsets, sizes, other, other_sizes,
                                                                       strict=True)) and math.prod(sizes):
                raise InvalidCheckpoint(f"{DCP_METADATA}: chunks of {key} overlap")
