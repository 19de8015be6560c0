"""A sharded checkpoint's tensors read from torch.distributed.checkpoint's (DCP's) files through the checkpoint's
storage backend, each rank reading only what it holds, and checking what it reads as it reads it.

Around DCP's own load:
- each rank checks every byte range it reads against the item checksums in ``items.json``
  (trainer.checkpoint.dcp_items), so a damaged file is found by the rank that reads it and no rank reads the whole
  checkpoint to check it;
- ``.metadata`` is read restricted (trainer.checkpoint.dcp_metadata): no code of the file's choosing runs;
- tensors load with ``weights_only=True``, and a non-tensor item (which DCP's own planner unpickles with
  ``weights_only=False``) is refused: this trainer asks for tensors only.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor

from trainer.checkpoint import dcp_items
from trainer.checkpoint.dcp_errors import failure_line, first_failure, quiet_when_alone
from trainer.checkpoint.dcp_items import ITEMS
from trainer.checkpoint.dcp_metadata import folder_metadata
from trainer.checkpoint.reading import InvalidCheckpoint, StorageUnreadable, agree, checked_read, load_failure
from trainer.checkpoint.save_failures import is_transient
from trainer.checkpoint.shards import MARK
from trainer.checkpoint.storage import CheckpointStorage, crc32_hex
from trainer.errors import CheckpointError, StorageUnavailable

__all__ = ["DcpSource"]


class _Reader(StorageReader):
    """Reads the byte ranges this rank's plan needs, each checked against its CRC-32 (``items``: None for a
    folder another tool wrote, which has none: its sizes are still checked)."""

    def __init__(self, storage: CheckpointStorage, folder: str, metadata: Metadata,
                 items: dict[str, dict[str, str]] | None) -> None:
        super().__init__()
        self.storage, self.folder, self.items = storage, folder, items
        # Read before DCP asks (folder_metadata): its own failure message would bury ours in an assertion's text.
        self.metadata = metadata
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.bytes_read = 0
        # Each saved chunk's shape, by its key and offsets: what a read of some of its rows needs.
        self.chunk_sizes = {(key, tuple(chunk.offsets)): list(chunk.sizes)
                            for key, value in metadata.state_dict_metadata.items()
                            if isinstance(value, TensorStorageMetadata) for chunk in value.chunks}

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        try:
            self._read(plan, planner)
        except (InvalidCheckpoint, StorageUnavailable):  # said in one line already
            raise
        except Exception as error:  # noqa: BLE001 - DCP sends it to every rank: one line, picklable
            if is_transient(error):  # the storage did not answer: the resume stops, to be retried (exit 200)
                raise StorageUnreadable(f"{self.folder} unreadable ({load_failure(error)})") from None
            raise InvalidCheckpoint(load_failure(error)) from None
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        for item in sorted(plan.items, key=lambda request: self._where(request)):
            if item.type == LoadItemType.BYTE_IO:  # this trainer asks for tensors only
                raise InvalidCheckpoint(f"{item.storage_index.fqn} is not a tensor in the checkpoint")
            info = self.storage_data[item.storage_index]
            layout = self._layout(info)
            if layout is not None:
                target = planner.resolve_tensor(item).detach()
                if self._read_into(target, item, info, layout):
                    planner.commit_tensor(item, target)
                else:
                    _copy_in(self._tensor_bytes(item, info, layout), item, planner)
                continue
            data = self._checked(info)
            try:
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as error:  # noqa: BLE001 - a foreign file's item: unusable, said in one line
                raise InvalidCheckpoint(f"an item of {item.storage_index.fqn} does not load with weights_only=True "
                                        f"({load_failure(error)})") from None
            if not isinstance(tensor, torch.Tensor):
                raise InvalidCheckpoint(f"the item of {item.storage_index.fqn} holds a {type(tensor).__name__}")
            _copy_in(_narrowed(tensor, item.storage_offsets, item.lengths), item, planner)

    def _layout(self, info: _StorageInfo) -> dcp_items.ItemLayout | None:
        """The item's layout with its parts' checksums; None where it is read whole and unpickled (a folder another
        tool wrote, which has no items.json, or an item whose entry is one CRC-32)."""
        if self.items is None:
            return None
        filename, offset = str(info.relative_path), int(info.offset)
        entry = self.items.get(filename, {}).get(str(offset))
        if entry is None:
            raise InvalidCheckpoint(f"{ITEMS} has no checksum for the item at byte {offset} of {filename}")
        return dcp_items.ItemLayout.of(entry, f"byte {offset} of {filename}", int(info.length))

    def _read_into(self, target: torch.Tensor, item: ReadItem, info: _StorageInfo,
                   layout: dcp_items.ItemLayout) -> bool:
        """A whole saved chunk read straight into the memory of the tensor it loads into, where that is its exact
        layout (a resume at the world size it was saved at) and the storage reads into memory (a local file; an
        object store's item is fetched once and copied, by ``_tensor_bytes``): no copy in between. False where it
        is not."""
        key = item.storage_index.fqn
        found = self.metadata.state_dict_metadata[key]
        sizes = self.chunk_sizes.get((key, tuple(item.storage_index.offset or ())))
        if (not self.storage.reads_into or not isinstance(found, TensorStorageMetadata)
                or target.dtype != found.properties.dtype
                or not dcp_items.plain_dtype(target.dtype) or sizes is None or list(target.shape) != sizes
                or list(item.lengths) != sizes or not target.is_contiguous() or target.device.type != "cpu"
                or target.numel() * target.element_size() != layout.length or layout.length == 0):
            return False
        memory = memoryview(target.reshape(-1).view(torch.uint8).numpy())
        self.bytes_read += dcp_items.read_whole_into(self.storage, self.folder, str(info.relative_path),
                                                     int(info.offset), int(info.length), layout, memory)
        return True

    def _tensor_bytes(self, item: ReadItem, info: _StorageInfo, layout: dcp_items.ItemLayout) -> torch.Tensor:
        """The part of a saved chunk the read asks for, taken from the item's bytes: only the blocks holding its
        rows are read where it wants rows of the chunk (a reshard), the whole item otherwise."""
        key = item.storage_index.fqn
        found = self.metadata.state_dict_metadata[key]
        sizes = self.chunk_sizes.get((key, tuple(item.storage_index.offset or ())))
        assert isinstance(found, TensorStorageMetadata)
        dtype = found.properties.dtype
        if not dcp_items.plain_dtype(dtype):
            raise InvalidCheckpoint(f"its metadata gives {key} the type {dtype}, whose items this trainer does not "
                                    f"read as bytes")
        if sizes is None or math.prod(sizes) * dtype.itemsize != layout.length:
            raise InvalidCheckpoint(f"an item of {key} holds {layout.length} bytes, which is not its chunk's shape "
                                    f"{sizes} of {dtype}")
        offsets, lengths = [int(value) for value in item.storage_offsets], [int(value) for value in item.lengths]
        rows_only = bool(sizes) and all(offset == 0 and length == size for offset, length, size
                                        in zip(offsets[1:], lengths[1:], sizes[1:], strict=True))
        row_bytes = math.prod(sizes[1:]) * dtype.itemsize if rows_only else 0
        first, end = ((offsets[0] * row_bytes, (offsets[0] + lengths[0]) * row_bytes) if rows_only
                      else (0, layout.length))
        shape = [lengths[0], *sizes[1:]] if rows_only else sizes
        if end == first:
            return torch.empty(shape, dtype=dtype)
        data, read = dcp_items.read_tensor_bytes(self.storage, self.folder, str(info.relative_path), int(info.offset),
                                                 int(info.length), layout, first, end)
        self.bytes_read += read
        with warnings.catch_warnings():  # read-only bytes: the tensor is copied out at once, never written
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(data, dtype=dtype).view(shape)
        return tensor if rows_only else _narrowed(tensor, offsets, lengths)

    def _where(self, request: ReadItem) -> tuple[str, int]:
        info = self.storage_data[request.storage_index]
        return str(info.relative_path), int(info.offset)

    def _checked(self, info: _StorageInfo) -> bytes:
        filename, offset, length = str(info.relative_path), int(info.offset), int(info.length)
        expected = None
        if self.items is not None:
            expected = self.items.get(filename, {}).get(str(offset))
            if expected is None:
                raise InvalidCheckpoint(f"{ITEMS} has no checksum for the item at byte {offset} of {filename}")
        with dcp_items.read_errors(filename):
            data = self.storage.read_range(self.folder, filename, offset, length)
        if len(data) != length:
            raise InvalidCheckpoint(f"{filename} ends before byte {offset + length} (truncated)")
        if expected is not None and crc32_hex(data) != expected:
            raise InvalidCheckpoint(f"{filename} does not match its item checksum at byte {offset} (corrupted)")
        self.bytes_read += length
        return data

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class DcpSource:
    """The tensors of a DCP-sharded checkpoint (format 5), loaded in one collective read (``prepare``) into
    what this run holds: a sharded tensor gets this rank's rows of it, read from the chunks that hold them; a plain
    one the whole tensor. ``fit`` (trainer.checkpoint.shards) then takes them by their markers."""

    def __init__(self, storage: CheckpointStorage, folder: str, manifest: dict[str, Any] | None, group: Any,
                 allocate: Callable[[list[int], torch.dtype], torch.Tensor] | None = None,
                 metadata: Metadata | None = None) -> None:
        self.storage, self.folder, self.manifest, self.group = storage, folder, manifest, group
        self.metadata = metadata  # the folder's, where the caller read it already (--init-from)
        # Where a whole tensor is read into (ddp-export gives file-backed memory, to write it out without holding it).
        self.allocate = allocate or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        self._loaded: dict[str, torch.Tensor] = {}
        self.bytes_read = 0

    def prepare(self, wanted: Iterable[tuple[dict[str, Any], Any]]) -> None:
        """Read every marked tensor at once: ``wanted`` pairs each marker with this run's tensor at its place
        (a DTensor: only its rows are read) or None (the whole tensor). What each rank reads alone first (the
        metadata, the checksums) is agreed on before the collective read, so that a rank that fails there fails
        every rank at once, in its words."""
        wanted = list(wanted)
        if not wanted:  # the same on every rank: nothing to read, no collective
            return
        alone = not dist.is_initialized()
        error, targets, reader, stops, transient = None, {}, None, False, False
        try:
            targets = self._targets(wanted)
            metadata = self.metadata or folder_metadata(self.storage, self.folder, self.manifest)
            reader = _Reader(self.storage, self.folder, metadata, self._items())
            for key, target in targets.items():
                found = reader.metadata.state_dict_metadata.get(key)
                if not isinstance(found, TensorStorageMetadata) or list(found.size) != list(target.shape):
                    held = f"of shape {list(found.size)}" if isinstance(found, TensorStorageMetadata) else "none"
                    raise InvalidCheckpoint(f"its metadata holds {held} for {key}, which is a tensor of shape "
                                            f"{list(target.shape)} here")
        except InvalidCheckpoint as problem:
            error = str(problem)
        except CheckpointError as problem:  # the storage did not answer (StorageUnreadable): the resume stops
            error, stops, transient = str(problem), True, is_transient(problem)
        except OSError as problem:  # the storage's: the resume stops, and is retried where a retry may read it
            error, stops = f"{self.folder} unreadable ({problem.strerror or problem})", True
            transient = is_transient(problem)
        agree(None if alone else self.group, error, stops, transient)
        assert reader is not None
        try:
            with quiet_when_alone(alone):
                dcp.load(targets, storage_reader=reader, planner=DefaultLoadPlanner(flatten_state_dict=False),
                         process_group=None if alone else self.group, no_dist=alone)
        except CheckpointException as failed:
            rank, error = first_failure(failed, 0)
            if isinstance(error, StorageUnavailable):  # relayed from the rank whose read failed
                raise StorageUnreadable(f"rank {rank}: {error}") from None
            raise InvalidCheckpoint(failure_line(failed)) from None
        self.bytes_read = reader.bytes_read
        self._loaded = targets

    def _targets(self, wanted: list[tuple[dict[str, Any], Any]]) -> dict[str, torch.Tensor]:
        targets: dict[str, torch.Tensor] = {}
        for marker, template in wanted:
            dtype = getattr(torch, str(marker["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise InvalidCheckpoint(f"a tensor of unknown type {marker['dtype']!r} ({marker[MARK]})")
            shape = [int(size) for size in marker["shape"]]
            if isinstance(template, DTensor) and list(template.shape) == shape:
                targets[marker[MARK]] = torch.empty_like(template, dtype=dtype)
            else:
                targets[marker[MARK]] = self.allocate(shape, dtype)
        return targets

    def _items(self) -> dict[str, dict[str, str]] | None:
        """items.json, checked against the manifest and its layout (None: a folder another tool wrote)."""
        if self.manifest is None:
            return None
        try:
            items = json.loads(checked_read(self.storage, self.folder, ITEMS, self.manifest))
        except ValueError as error:
            raise InvalidCheckpoint(f"{ITEMS} is not valid JSON ({error})") from None
        if not isinstance(items, dict) or not all(
                isinstance(offsets, dict) and all(isinstance(entry, str | dict) for entry in offsets.values())
                for offsets in items.values()):
            raise InvalidCheckpoint(f"{ITEMS} does not have the layout this trainer writes")
        return items

    def rows(self, marker: dict[str, Any], first: int, count: int) -> torch.Tensor:
        value = self._loaded[marker[MARK]]
        if isinstance(value, DTensor):
            return value.to_local()  # exactly this rank's rows: fit asks for them
        return value[first:first + count]

    def whole(self, marker: dict[str, Any]) -> torch.Tensor:
        value = self._loaded[marker[MARK]]
        return value.full_tensor() if isinstance(value, DTensor) else value

    def close(self) -> None:
        self._loaded.clear()


def _copy_in(tensor: torch.Tensor, item: ReadItem, planner: LoadPlanner) -> None:
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise InvalidCheckpoint(f"an item of {item.storage_index.fqn} has shape {list(tensor.size())} where its "
                                f"metadata says {list(target.size())}")
    target.copy_(tensor)
    planner.commit_tensor(item, target)


def _narrowed(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The part of a saved chunk that a read asks for (the overlap of the chunk and this rank's rows)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if tensor.size(dim) != length:
            tensor = tensor.narrow(dim, int(offset), int(length))
    return tensor
