"""A DCP item read by the part a reader needs (trainer.checkpoint.dcp_items): only the blocks holding the rows asked
for, each checked; the whole item with its head and tail where all of it is wanted; the tensor's bytes taken as
they lie in the torch.save record."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from trainer.checkpoint.dcp_items import BLOCK, ItemLayout, describe, read_tensor_bytes
from trainer.checkpoint.dcp_writer import _serialised
from trainer.checkpoint.reading import InvalidCheckpoint
from trainer.checkpoint.storage import open_storage

ROWS, COLUMNS = 3000, 700  # 8.4 MB of float32: 9 blocks
PADDING = 123  # the item lies after other bytes in its file, as every item but a file's first does


@pytest.fixture
def item(tmp_path: Path) -> tuple[torch.Tensor, ItemLayout, int, Path]:
    tensor = torch.arange(ROWS * COLUMNS, dtype=torch.float32).reshape(COLUMNS, ROWS).t()  # rows not in order
    payload, tensor_bytes = _serialised(tensor)
    layout = ItemLayout.of(describe(payload, tensor_bytes), "test")
    assert layout is not None and layout.length == ROWS * COLUMNS * 4 and len(layout.blocks) == 9
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "__0_0.distcp").write_bytes(b"x" * PADDING + bytes(payload))
    return tensor, layout, len(payload), tmp_path / "ckpt" / "__0_0.distcp"


def read_rows(path: Path, layout: ItemLayout, length: int, first: int, count: int) -> tuple[torch.Tensor, int]:
    row = COLUMNS * 4
    data, read = read_tensor_bytes(open_storage(str(path.parent.parent)), path.parent.name, path.name, PADDING,
                                   length, layout, first * row, (first + count) * row)
    return torch.frombuffer(bytearray(data), dtype=torch.float32).view(count, COLUMNS), read


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(at)
        byte = handle.read(1)
        handle.seek(at)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_some_rows_are_read_from_the_blocks_that_hold_them_and_all_from_the_whole_item(item):
    tensor, layout, length, path = item
    rows, read = read_rows(path, layout, length, 1000, 500)
    assert torch.equal(rows, tensor[1000:1500]) and 500 * COLUMNS * 4 <= read <= 500 * COLUMNS * 4 + 2 * BLOCK
    everything, read = read_rows(path, layout, length, 0, ROWS)
    assert torch.equal(everything, tensor) and read == length


def test_a_damaged_byte_is_found_where_it_is_read_and_only_there(item):
    _, layout, length, path = item
    flip(path, PADDING + 5)  # in the head: only a whole read checks it
    read_rows(path, layout, length, 1000, 500)
    with pytest.raises(InvalidCheckpoint, match=rf"^__0_0.distcp does not match its item checksum at byte "
                                                rf"{PADDING} \(corrupted\)$"):
        read_rows(path, layout, length, 0, ROWS)
    flip(path, PADDING + 5)
    flip(path, PADDING + layout.start + 1200 * COLUMNS * 4)  # in the rows read
    read_rows(path, layout, length, 0, 500)
    with pytest.raises(InvalidCheckpoint, match="does not match its item checksum"):
        read_rows(path, layout, length, 1000, 500)


def test_an_item_of_bytes_or_an_entry_of_another_shape_is_told_apart():
    buffer = io.BytesIO(b"not a tensor")
    payload, tensor_bytes = _serialised(buffer)
    assert tensor_bytes is None and isinstance(describe(payload, tensor_bytes), str)
    assert ItemLayout.of("1234abcd", "x") is None  # one CRC-32: an item written before, read whole
    good = {"data": [64, 10], "head": "0", "tail": "0", "blocks": ["0"]}
    assert ItemLayout.of(good, "x", 74) is not None
    for entry, length in ((good, 73), ({**good, "data": [0, 10]}, 100), ({**good, "blocks": []}, 100),
                          ({**good, "data": [float("inf"), 1]}, 100), ({"data": "x"}, 100), (7, 100)):
        # bytes past the item (the next item's), the zip's own header taken for the tensor, blocks missing, ...
        with pytest.raises(InvalidCheckpoint, match="^items.json does not describe the item at x$"):
            ItemLayout.of(entry, "x", length)


def saved_and_read(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
    """Saved through DCP by this process alone, then read back whole through the reader DCP calls."""
    from trainer.checkpoint import dcp_metadata, dcp_reader, dcp_writer

    storage = open_storage(str(tmp_path))
    folder = storage.begin("step-00000001")
    written = dcp_writer.save(tensors, {}, storage, folder, 0, None)
    reader = dcp_reader._Reader(storage, folder, dcp_metadata.folder_metadata(storage, folder, None), written.items)
    reader.set_up_storage_reader(reader.metadata, True)
    read = {}
    for index, info in reader.storage_data.items():
        layout = reader._layout(info)
        assert layout is not None, index  # every one of these is read by its parts
        size = torch.Size(reader.chunk_sizes[(index.fqn, tuple(index.offset))])
        wanted = ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=torch.Size([0] * len(size)),
                          storage_index=index, storage_offsets=torch.Size([0] * len(size)), lengths=size)
        read[index.fqn] = reader._tensor_bytes(wanted, info, layout).clone()
    return read, reader


def test_what_only_a_tensors_pickle_says_is_in_its_bytes_or_it_is_read_whole_as_before(tmp_path):
    """A conjugate or negative view's record holds the bytes before its flag: saved resolved, so that its bytes
    are its values. A quantized type's bytes are not its values: such a type in the metadata is refused."""
    complex_values = torch.tensor([[1 + 2j, 3 - 4j]], dtype=torch.complex64)
    tensors = {"model.conj": complex_values.conj(), "model.neg": torch._neg_view(torch.tensor([[1.0, -2.0]])),
               "model.step": torch.tensor(3.0)}
    read, reader = saved_and_read(tmp_path, tensors)
    for key, tensor in tensors.items():
        assert torch.equal(read[key], tensor.resolve_conj().resolve_neg()), key
    reader.metadata.state_dict_metadata["model.neg"].properties.dtype = torch.qint8  # a hostile .metadata
    index = next(index for index in reader.storage_data if index.fqn == "model.neg")
    wanted = ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=torch.Size([0, 0]),
                      storage_index=index, storage_offsets=torch.Size([0, 0]), lengths=torch.Size([1, 2]))
    with pytest.raises(InvalidCheckpoint, match=r"^its metadata gives model.neg the type torch.qint8, whose items "
                                                r"this trainer does not read as bytes$"):
        reader._tensor_bytes(wanted, reader.storage_data[index], reader._layout(reader.storage_data[index]))


def test_a_reshards_read_takes_the_blocks_of_its_rows_from_a_chunk_dcp_saved(tmp_path):
    """Through the reader DCP calls: a rank that wants rows 1000-1499 of a saved 3000-row chunk (a reshard) reads
    about their bytes, not the chunk's."""
    from trainer.checkpoint import dcp_metadata, dcp_reader, dcp_writer

    storage = open_storage(str(tmp_path))
    folder = storage.begin("step-00000001")
    tensor = torch.randn(ROWS, COLUMNS)
    written = dcp_writer.save({"model.weight": tensor}, {}, storage, folder, 0, None)
    reader = dcp_reader._Reader(storage, folder, dcp_metadata.folder_metadata(storage, folder, None), written.items)
    reader.set_up_storage_reader(reader.metadata, True)
    index = MetadataIndex("model.weight", torch.Size([0, 0]))
    wanted = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("model.weight", torch.Size([1000, 0])),
                      dest_offsets=torch.Size([0, 0]), storage_index=index, storage_offsets=torch.Size([1000, 0]),
                      lengths=torch.Size([500, COLUMNS]))
    info = reader.storage_data[index]
    rows = reader._tensor_bytes(wanted, info, reader._layout(info))
    assert torch.equal(rows, tensor[1000:1500])
    assert 500 * COLUMNS * 4 <= reader.bytes_read <= 500 * COLUMNS * 4 + 2 * BLOCK < ROWS * COLUMNS * 4


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_whole_chunk_is_read_straight_into_the_tensor_it_loads_into_and_still_checked(where, tmp_path):
    """A resume at the world size of the save: each chunk's bytes go straight into the rank's tensor from a local
    file (one preadv into its memory and the head's and tail's buffers); an object store's item is fetched in one
    request and copied in. Head, blocks and tail checked either way."""
    import uuid

    from trainer.checkpoint import dcp_metadata, dcp_reader, dcp_writer

    location = str(tmp_path) if where == "local" else f"memory://items-{uuid.uuid4().hex}"
    storage = open_storage(location)
    folder = storage.begin("step-00000001")
    tensor = torch.randn(ROWS, COLUMNS)
    written = dcp_writer.save({"model.weight": tensor}, {}, storage, folder, 0, None)
    reader = dcp_reader._Reader(storage, folder, dcp_metadata.folder_metadata(storage, folder, None), written.items)
    reader.set_up_storage_reader(reader.metadata, True)
    [(index, info)] = reader.storage_data.items()
    whole = ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=torch.Size([0, 0]), storage_index=index,
                     storage_offsets=torch.Size([0, 0]), lengths=torch.Size([ROWS, COLUMNS]))
    target = torch.empty(ROWS, COLUMNS)

    def load() -> torch.Tensor:
        if reader._read_into(target, whole, info, reader._layout(info)):
            return target
        assert where == "memory"
        return reader._tensor_bytes(whole, info, reader._layout(info))

    assert torch.equal(load(), tensor) and reader.bytes_read == info.length
    assert not reader._read_into(torch.empty(ROWS, COLUMNS, dtype=torch.float64), whole, info, reader._layout(info))
    data = bytearray(storage.read(folder, "__0_0.distcp"))
    data[len(data) // 2] ^= 0xFF
    if where == "local":
        (tmp_path / folder / "__0_0.distcp").write_bytes(data)
    else:
        storage.fs.pipe_file(storage._path(folder, "__0_0.distcp"), bytes(data))
    with pytest.raises(InvalidCheckpoint, match=r"^__0_0.distcp does not match its item checksum at byte 0 "
                                                r"\(corrupted\)$"):
        load()


def test_a_short_read_goes_on_into_what_is_left_of_the_buffers():
    from trainer.checkpoint.storage.base import remaining

    buffers = [memoryview(bytearray(3)), memoryview(bytearray(4)), memoryview(bytearray(2))]
    assert [len(piece) for piece in remaining(buffers, 0)] == [3, 4, 2]
    assert [len(piece) for piece in remaining(buffers, 5)] == [2, 2]
    assert [len(piece) for piece in remaining(buffers, 7)] == [2] and remaining(buffers, 9) == []
