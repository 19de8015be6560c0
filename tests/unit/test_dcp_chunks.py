"""A tensor's chunks as DCP's metadata lists them (trainer.checkpoint.dcp_chunks.check_chunks): a tiling is taken,
and a chunk outside the tensor, two chunks sharing elements, or elements no chunk holds are refused in one line.
Tilings of any size are checked, 4096 x 4096 in a grid of 64 x 8 chunks among them (TorchTitan's 2-D sharding)."""

from __future__ import annotations

import re
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from trainer.checkpoint.dcp_chunks import check_chunks
from trainer.checkpoint.reading import DCP_METADATA, InvalidCheckpoint

Box = tuple[list[int], list[int]]  # a chunk's offsets and sizes


def grid(size: list[int], rows: int, columns: int) -> list[Box]:
    """A 2-D tensor cut into rows x columns equal chunks."""
    height, width = size[0] // rows, size[1] // columns
    return [([row * height, column * width], [height, width]) for row in range(rows) for column in range(columns)]


def check(size: list[int], boxes: list[Box]) -> None:
    chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in boxes]
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), chunks)
    check_chunks("model.weight", tensor, {MetadataIndex("model.weight", chunk.offsets): None for chunk in chunks})


def refused(message: str) -> AbstractContextManager[Any]:
    return pytest.raises(InvalidCheckpoint, match=f"^{re.escape(f'{DCP_METADATA}: {message}')}$")


def test_a_grid_of_64_by_8_chunks_is_a_tiling():
    check([128, 16], grid([128, 16], 64, 8))


def test_bricks_laid_in_staggered_rows_are_a_tiling():
    """Not a grid: each row of bricks, two wide, starts one on from the row under it."""
    boxes: list[Box] = []
    for row in range(8):
        edges = [0, *range(1 + row % 2, 8, 2), 8]
        boxes += [([row, start], [1, end - start]) for start, end in zip(edges, edges[1:], strict=False)]
    check([8, 8], boxes)


def test_a_chunk_moved_onto_its_neighbour_overlaps_it():
    """The same number of elements as the tensor: only the overlap check finds that some are held twice (and the
    ones the moved chunk left are held by none)."""
    boxes = grid([128, 16], 64, 8)
    offsets, sizes = boxes[9]
    boxes[9] = ([offsets[0], offsets[1] + 1], sizes)
    with refused("chunks of model.weight overlap"):
        check([128, 16], boxes)


def test_row_slabs_that_overlap_are_refused():
    with refused("chunks of model.weight overlap"):
        check([6, 4], [([0, 0], [3, 4]), ([2, 0], [3, 4])])


def test_a_gap_is_refused():
    boxes = grid([128, 16], 64, 8)
    del boxes[100]
    with refused("the chunks of model.weight do not cover it exactly once"):
        check([128, 16], boxes)


def test_a_chunk_out_of_the_tensors_bounds_is_refused():
    boxes = grid([128, 16], 64, 8)
    boxes[-1] = ([126, 15], [2, 2])
    with refused("a chunk of model.weight lies outside its shape [128, 16]"):
        check([128, 16], boxes)


def test_a_large_tiling_is_checked_whole():
    """4096 x 4096 in 64 x 8 chunks: 512 chunks, each compared with the few beside it, not with all 511 others."""
    size = [4096, 4096]
    check(size, grid(size, 64, 8))
    boxes = grid(size, 64, 8)
    offsets, sizes = boxes[300]
    boxes[300] = ([offsets[0] + 1, offsets[1]], sizes)
    with refused("chunks of model.weight overlap"):
        check(size, boxes)
