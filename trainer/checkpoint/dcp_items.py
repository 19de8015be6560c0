"""One item of a DCP data file, checked by the part a reader reads, and its tensor's bytes taken without unpickling.

An item is a ``torch.save`` record of one tensor: a head (the zip's local header, the pickle), the tensor's bytes
(stored uncompressed, contiguous, in the machine's byte order: little-endian on every machine this trainer runs
on), and a tail (the zip's directory). ``items.json`` holds, for each item written since 2026-11-26, the CRC-32
of its head, of every ``BLOCK`` bytes of the tensor's bytes and of its tail, and where those bytes lie in it. A rank
that needs only some rows of a saved chunk (a reshard) reads and checks just the blocks that hold them; a rank
that needs the whole chunk reads and checks the whole item. Either way the tensor is copied out of the bytes read,
with no unpickled copy in between. An item whose entry is one CRC-32 (written before) is read whole and loaded
with ``torch.load`` as it was then (trainer.checkpoint.dcp_reader).
"""

from __future__ import annotations

import contextlib
import io
import re
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainer.checkpoint.reading import InvalidCheckpoint, storage_failure
from trainer.checkpoint.storage import CheckpointStorage, crc32_hex

__all__ = ["BLOCK", "ITEMS", "ItemLayout", "describe", "plain_dtype", "read_errors", "read_tensor_bytes",
           "read_whole_into"]

ITEMS = "items.json"  # every item's checksums, by data file and offset
# What a reshard may read beyond the rows it needs: up to a block before them and one after, per item.
BLOCK = 1 << 20
_STORAGE_ENTRY = re.compile(r"(^|/)data/\d+$")  # where torch.save puts a storage's bytes in its zip
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra field length (30 bytes)
_BYTES_ARE_VALUES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                     torch.uint32, torch.uint64}


@dataclass(frozen=True)
class ItemLayout:
    """Where an item's tensor bytes lie in it, and the CRC-32 of each part."""

    start: int  # the tensor's bytes, from the item's first byte
    length: int
    head: str
    blocks: list[str]  # one per BLOCK bytes of the tensor's bytes, the last one shorter
    tail: str

    def to_json(self) -> dict[str, Any]:
        return {"data": [self.start, self.length], "head": self.head, "blocks": self.blocks, "tail": self.tail}

    @classmethod
    def of(cls, entry: Any, where: str, item_length: int | None = None) -> ItemLayout | None:
        """An items.json entry read back, for an item of ``item_length`` bytes: None for one CRC-32 (an item
        written before); InvalidCheckpoint for an entry that is neither, or whose tensor bytes lie outside the
        item or where its zip's first header is."""
        if isinstance(entry, str):
            return None
        try:
            start, length = (int(value) for value in entry["data"])
            head, blocks, tail = entry["head"], list(entry["blocks"]), entry["tail"]
        except (KeyError, TypeError, ValueError, OverflowError):
            raise InvalidCheckpoint(f"items.json does not describe the item at {where}") from None
        if (start < _LOCAL_HEADER.size or length < 0 or len(blocks) != -(-length // BLOCK)
                or (item_length is not None and start + length > item_length)
                or not all(isinstance(crc, str) for crc in (head, tail, *blocks))):
            raise InvalidCheckpoint(f"items.json does not describe the item at {where}")
        return cls(start, length, head, blocks, tail)


def plain_dtype(dtype: torch.dtype) -> bool:
    """A type whose values are their bytes (floating, complex, integer, bool): not a quantized one, whose scale
    and zero point only the record's pickle holds."""
    return dtype.is_floating_point or dtype.is_complex or dtype in _BYTES_ARE_VALUES


def describe(payload: memoryview | bytes, tensor_bytes: int | None) -> dict[str, Any] | str:
    """items.json's entry for an item: its layout with its parts' CRC-32s where it is one stored tensor of
    ``tensor_bytes`` bytes, else one CRC-32 of the whole (an item of bytes)."""
    view = memoryview(payload).cast("B")
    start = None if tensor_bytes is None else _tensor_start(view, tensor_bytes)
    if start is None:
        return crc32_hex(view)
    assert tensor_bytes is not None
    end = start + tensor_bytes
    blocks = [crc32_hex(view[offset:min(offset + BLOCK, end)]) for offset in range(start, end, BLOCK)]
    return ItemLayout(start, tensor_bytes, crc32_hex(view[:start]), blocks, crc32_hex(view[end:])).to_json()


def _tensor_start(view: memoryview, tensor_bytes: int) -> int | None:
    """Where the one storage of a torch.save record starts in it, if it is stored whole and uncompressed."""
    with zipfile.ZipFile(_ViewReader(view)) as archive:
        storages = [info for info in archive.infolist() if _STORAGE_ENTRY.search(info.filename)]
    if len(storages) != 1 or storages[0].compress_type != zipfile.ZIP_STORED or storages[0].file_size != tensor_bytes:
        return None
    header = storages[0].header_offset
    signature, name_length, extra_length = _LOCAL_HEADER.unpack_from(view, header)
    if signature != b"PK\x03\x04":
        return None
    return header + _LOCAL_HEADER.size + name_length + extra_length


class _ViewReader(io.RawIOBase):
    """A seekable file over bytes in memory without copying them (io.BytesIO would copy the whole record)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view, self.position = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: len(self.view)}[whence]
        self.position = max(0, base + offset)
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), len(self.view) - self.position))
        buffer[:count] = self.view[self.position:self.position + count]
        self.position += count
        return count


@contextlib.contextmanager
def read_errors(filename: str) -> Iterator[None]:
    """A data file that cannot be read, in one line: gone since rank 0 checked it, or unreadable."""
    try:
        yield
    except FileNotFoundError:
        raise InvalidCheckpoint(f"{filename} is missing (its metadata names it)") from None
    except OSError as error:
        # The storage's, not the checkpoint's: the resume stops (retried where a retry may read it), never skips
        # to an older checkpoint.
        raise storage_failure(f"{filename} unreadable ({error.strerror or error})", error) from None


def read_whole_into(storage: CheckpointStorage, folder: str, filename: str, offset: int, item_length: int,
                    layout: ItemLayout, into: memoryview) -> int:
    """The item at ``offset`` read in one request, its tensor's bytes straight into ``into`` (``layout.length``
    bytes: a tensor's memory), its head and tail beside them, every part checked; how many bytes were read. On a
    failure ``into`` holds what was read: the load that gave it fails."""
    head, tail = bytearray(layout.start), bytearray(item_length - layout.start - layout.length)
    with read_errors(filename):
        got = storage.read_range_into(folder, filename, offset, [memoryview(head), into, memoryview(tail)])
    if got != item_length:
        raise InvalidCheckpoint(f"{filename} ends before byte {offset + item_length} (truncated)")
    checks = [(memoryview(head), layout.head), (memoryview(tail), layout.tail),
              *((into[start:start + BLOCK], crc) for start, crc in zip(range(0, layout.length, BLOCK), layout.blocks,
                                                                      strict=True))]
    if any(crc32_hex(piece) != expected for piece, expected in checks):
        raise InvalidCheckpoint(f"{filename} does not match its item checksum at byte {offset} (corrupted)")
    return item_length


def read_tensor_bytes(storage: CheckpointStorage, folder: str, filename: str, offset: int, item_length: int,
                      layout: ItemLayout, first: int, end: int) -> tuple[memoryview, int]:
    """Bytes ``[first, end)`` of the tensor in the item at ``offset`` of ``filename`` (``item_length`` bytes long),
    every byte read checked, and how many bytes were read. All of them: the whole item is read, its head and tail
    checked too; some: only the blocks that hold them."""
    whole = first == 0 and end == layout.length
    begin, stop = ((-layout.start, item_length - layout.start) if whole else
                   ((first // BLOCK) * BLOCK, min(-(-end // BLOCK) * BLOCK, layout.length)))
    with read_errors(filename):
        data = storage.read_range(folder, filename, offset + layout.start + begin, stop - begin)
    if len(data) != stop - begin:
        raise InvalidCheckpoint(f"{filename} ends before byte {offset + layout.start + stop} (truncated)")
    view = memoryview(data)
    parts = [(view[:layout.start], layout.head), (view[layout.start + layout.length:], layout.tail)] if whole else []
    for index in range(max(0, begin) // BLOCK, -(-min(stop, layout.length) // BLOCK)):
        parts.append((view[index * BLOCK - begin:min((index + 1) * BLOCK, layout.length) - begin],
                      layout.blocks[index]))
    if any(crc32_hex(piece) != expected for piece, expected in parts):
        raise InvalidCheckpoint(f"{filename} does not match its item checksum at byte {offset} (corrupted)")
    return view[first - begin:end - begin], len(data)
