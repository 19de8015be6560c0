"""A sharded checkpoint's tensors in torch.distributed.checkpoint's (DCP's) layout, written and read through the
checkpoint's storage backend, with this trainer's guarantees around DCP.

The files are DCP's own: one ``__R_0.distcp`` per writing rank (each tensor chunk a ``torch.save`` at an offset)
and ``.metadata`` (which chunk of which tensor lies where), so a plain ``dcp.load`` reads the checkpoint folder, as
do the tools built on DCP (TorchTitan's, torchtune's, ``dcp_to_torch_save``). DCP plans the save: a chunk held by
several ranks (an HSDP replica's, a plain tensor every rank holds) is written once, by the rank with the least to
write so far, so the replicas share the writing. Keys are names: ``model.<parameter>``,
``optimizer.state.<parameter>.exp_avg`` (DCP's flattening of ``{"model": ..., "optimizer": ...}``); what is not
a tensor stays in the checkpoint's own state file.

Around DCP:
- every item (one tensor chunk) is checksummed as it is written; the CRC-32s go to ``items.json`` and each rank
  checks every byte range it reads against them, so a damaged file is found by the rank that reads it and no rank
  reads the whole checkpoint to check it;
- ``.metadata`` is a pickle, and torch's own reader loads it with ``pickle.load``: a DCP folder can run code when
  loaded. It is read here by an unpickler that admits DCP's metadata types only, and refuses anything else in one
  line; tensors load with ``weights_only=True``, and a non-tensor item (which DCP's own planner unpickles with
  ``weights_only=False``) is refused: this trainer asks for tensors only;
- a file the metadata names outside the folder is refused.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import pickle
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor

from trainer.checkpoint import dcp_items
from trainer.checkpoint.reading import (
    DCP_METADATA,
    InvalidCheckpoint,
    agree,
    checked_read,
    is_plain_name,
    load_failure,
)
from trainer.checkpoint.shards import MARK, marker_for, replace_tensors
from trainer.checkpoint.storage import CheckpointStorage, crc32_hex
from trainer.errors import CheckpointError
from trainer.sharding import local_rows

__all__ = ["ITEMS", "DcpSource", "RankFailed", "Shard", "data_file", "read_metadata", "save", "split"]

ITEMS = "items.json"  # every item's CRC-32, by file and offset


# What DCP's metadata pickles: its own dataclasses, and the torch types they hold. Nothing here runs code of the
# file's choosing: the classes are rebuilt from their fields, _get_layout and the memory-format enum look a name up.
_METADATA_TYPES = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch.serialization", "_MEM_FORMAT_ENCODING"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
}


# The chunks of one tensor this trainer reads at most: one per rank that wrote it (a pairwise check of chunks
# that are not row slabs, TorchTitan's tensor-parallel ones, costs their square).
MAX_CHUNKS = 4096
# DCP's records, the only objects whose fields the metadata may set.
_RECORDS = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
            MetadataIndex, StorageMeta, _StorageInfo)


def data_file(rank: int) -> str:
    """The file a rank writes its items to (DCP's FileSystemWriter names it alike)."""
    return f"__{rank}_0.distcp"


# -- saving ---------------------------------------------------------------------------------------------------
@dataclass
class Shard:
    """This rank's rows of a sharded tensor, apart from the DTensor (under --async-checkpoint, a host copy of them):
    what DCP needs to plan the save, the chunk and where it lies in the whole tensor."""

    local: torch.Tensor
    size: torch.Size  # the whole tensor's
    offsets: torch.Size  # of the chunk in it

    def __create_write_items__(self, fqn: str, _: Any) -> list[WriteItem]:
        chunk = ChunkStorageMetadata(offsets=self.offsets, sizes=torch.Size(self.local.shape))
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=_properties(self.local),
                                                      size=self.size))]


def _properties(tensor: torch.Tensor) -> TensorProperties:
    # Not pinned, whatever the host copy is: the metadata describes the tensor, not this rank's staging buffer.
    return TensorProperties(dtype=tensor.dtype, requires_grad=False, pin_memory=False)


@dataclass
class SplitState:
    """A rank's parts with their tensors taken out for DCP."""

    plain: dict[str, Any]  # the parts, each tensor of a replicated part replaced by its marker
    tensors: dict[str, torch.Tensor]  # DCP key -> this rank's tensor (a sharded one's local rows)
    layout: dict[str, tuple[torch.Size, torch.Size]]  # a sharded tensor's key -> (whole size, its chunk's offsets)


def split(parts: dict[str, Any], per_rank: Iterable[str]) -> SplitState:
    """Every tensor of the replicated parts, sharded or not, goes to DCP; per-rank parts (the random generators)
    stay whole in the state file."""
    state = SplitState({}, {}, {})
    kept = set(per_rank)

    def take(tensor: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        key = ".".join(map(str, path))  # DCP's flattening of the nested dict: optimizer.state.fc.weight.exp_avg
        if isinstance(tensor, DTensor):
            first, _ = local_rows(tensor)
            state.layout[key] = (torch.Size(tensor.shape), torch.Size([first] + [0] * (tensor.dim() - 1)))
            state.tensors[key] = tensor.to_local().detach()
        else:
            state.tensors[key] = tensor.detach()
        return marker_for(key, tensor)

    state.plain = {name: value if name in kept else replace_tensors(value, take, (name,))
                   for name, value in parts.items()}
    return state


@dataclass
class Written:
    """What one rank's part of a save wrote: its files' sizes and CRC-32s, and its items' CRC-32s by offset."""

    files: dict[str, dict[str, Any]]
    items: dict[str, dict[str, Any]]  # file -> offset -> the item's checksums (trainer.checkpoint.dcp_items)


def save(tensors: dict[str, torch.Tensor], layout: dict[str, tuple[torch.Size, torch.Size]],
         storage: CheckpointStorage, folder: str, rank: int, group: Any, failed: BaseException | None = None
         ) -> Written:
    """Write this rank's share of the tensors into ``folder`` (a DCP save: collective over ``group``, or alone
    where there is no process group); the rank that coordinates writes ``.metadata`` too. ``failed``: what went
    wrong on this rank before (its copies): the save is entered anyway and fails on every rank with it."""
    state_dict: dict[str, Any] = {key: Shard(tensor, *layout[key]) if key in layout else tensor
                                  for key, tensor in tensors.items()}
    writer = _Writer(storage, folder, rank)
    alone = not dist.is_initialized()
    try:
        with _quiet_when(alone):
            dcp.save(state_dict, storage_writer=writer, planner=_SavePlanner(failed),
                     process_group=None if alone else group, no_dist=alone)
    except CheckpointException as failed:  # a BaseException: an `except Exception` would let it end the thread
        raise RankFailed(*first_failure(failed, rank)) from None
    return Written(writer.files, {data_file(rank): writer.items} if writer.items else {})


class _SavePlanner(DefaultSavePlanner):
    def __init__(self, failed: BaseException | None = None) -> None:
        super().__init__(flatten_state_dict=False)  # the keys are flat already, as DCP would have made them
        self.failed = failed

    def create_local_plan(self) -> SavePlan:
        if self.failed is not None:  # raised inside DCP's first exchange: every rank learns it there
            raise _plain(self.failed)
        return super().create_local_plan()

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        return value.local if isinstance(value, Shard) else super().lookup_object(index)


class _Writer(StorageWriter):
    """DCP's file layout written through a storage backend: one file per rank, each item a ``torch.save`` at its
    offset (what DCP's FileSystemReader reads), each checksummed on its way out."""

    def __init__(self, storage: CheckpointStorage, folder: str, rank: int) -> None:
        super().__init__()
        self.storage, self.folder, self.rank = storage, folder, rank
        self.files: dict[str, dict[str, Any]] = {}
        self.items: dict[str, Any] = {}  # offset -> the checksums of the item there (dcp_items.describe)

    def reset(self, checkpoint_id: Any = None) -> None:
        self.files, self.items = {}, {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        filename, results = data_file(self.rank), []

        def write(handle: Any) -> None:
            offset = 0
            for item in plan.items:
                payload, tensor_bytes = _serialised(planner.resolve_data(item))
                handle.write(payload)
                self.items[str(offset)] = dcp_items.describe(payload, tensor_bytes)
                results.append(WriteResult(index=item.index, size_in_bytes=len(payload),
                                           storage_data=_StorageInfo(filename, offset, len(payload))))
                offset += len(payload)

        if plan.items:
            try:
                self.files[filename] = self.storage.write_file(self.folder, filename, write)
            except Exception as error:  # noqa: BLE001 - DCP sends it to every rank: a plain, picklable one
                raise _plain(error) from None
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinating rank, once every rank has written: the metadata, naming every item's place."""
        metadata.version = "1.0.0"  # DCP's own, for its readers
        metadata.storage_data = {result.index: result.storage_data for written in results for result in written}
        metadata.storage_meta = None
        self.files[DCP_METADATA] = self.storage.write_file(self.folder, DCP_METADATA,
                                                           lambda handle: pickle.dump(metadata, handle))

    def storage_meta(self) -> None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


@contextlib.contextmanager
def _quiet_when(alone: bool) -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: here that is the intent (ddp-export,
    a one-process run). The warnings filter is the process's: touched only then."""
    if not alone:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class Relayed(RuntimeError):
    """Another rank's error as DCP relays it: its type's name and its words, in one line."""


def _plain(error: BaseException) -> Exception:
    """An error DCP can send to the other ranks (it pickles them): an OSError as its number and words, anything
    else as its one line."""
    if isinstance(error, InvalidCheckpoint):
        return error
    if isinstance(error, OSError):
        return OSError(error.errno, str(error.strerror or error))
    if isinstance(error, Relayed):
        return error
    return Relayed(f"{type(error).__name__}: {' '.join(str(error).split())[:300]}")


def _serialised(data: torch.Tensor | io.BytesIO) -> tuple[memoryview | bytes, int | None]:
    """An item's record, and how many bytes its tensor's are (None: an item of bytes)."""
    if isinstance(data, io.BytesIO):
        return data.getbuffer(), None
    # A conjugate or negative view's record holds the bytes before the flag, which only its pickle says: resolved
    # here, so that the bytes are the values (a no-op for any other tensor).
    tensor = data.detach().cpu().resolve_conj().resolve_neg()
    size = tensor.numel() * tensor.element_size()
    if type(tensor) is not torch.Tensor or tensor.is_quantized or not dcp_items.plain_dtype(tensor.dtype):
        size = None  # its pickle holds more than the bytes (a scale, a subclass's state): read whole and unpickled
    elif not tensor.is_contiguous() or tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != size:
        # A view (torch.save would write the whole storage behind it), or rows in another order: a reader copies
        # rows out of the record's bytes as they lie.
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getbuffer(), size


# -- loading --------------------------------------------------------------------------------------------------
class _MetadataUnpickler(pickle._Unpickler):  # the Python one: its BUILD can be checked (the C one's cannot)
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_TYPES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("builtins", "getattr"):
            return _memory_format_member  # how some Pythons (3.11.2, 3.12) pickle an enum member: by its name
        raise InvalidCheckpoint(f"{DCP_METADATA} holds {module}.{name}, which is none of DCP's metadata types: "
                                f"refused (a pickle can run code when loaded)")

    def persistent_load(self, pid: Any) -> Any:
        raise InvalidCheckpoint(f"{DCP_METADATA} holds a persistent reference, which DCP's metadata never does")

    def _build(self) -> None:
        # BUILD sets attributes of the object under it: only ever the fields of one of DCP's own records (on a
        # class or a function it would change them for the whole process).
        target, state = self.stack[-2], self.stack[-1]
        slots = state[1] if isinstance(state, tuple) and len(state) == 2 and type(target) is not TensorProperties \
            else None
        if type(target) not in _RECORDS or slots is not None:
            raise InvalidCheckpoint(f"{DCP_METADATA} sets attributes of {type(target).__name__}, which DCP's "
                                    f"metadata never does: refused")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _build


def _memory_format_member(owner: Any, name: Any) -> Any:
    """``getattr`` as DCP's metadata uses it: a member of its memory-format enum, by name, and nothing else."""
    if owner is not _MEM_FORMAT_ENCODING or not isinstance(name, str) or name not in _MEM_FORMAT_ENCODING.__members__:
        what = getattr(owner, "__name__", type(owner).__name__)
        raise InvalidCheckpoint(f"{DCP_METADATA} looks up {name!r} of {what}, which DCP's metadata never does: "
                                f"refused")
    return _MEM_FORMAT_ENCODING[name]


def read_metadata(data: bytes) -> Metadata:
    """DCP's metadata from its bytes, admitting its own types only, and its layout checked: every tensor's chunks
    lie inside it, cover it exactly once and have their place in a file of the folder."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except InvalidCheckpoint:
        raise
    except Exception as error:  # noqa: BLE001 - any unpickling failure means the same: unusable
        raise InvalidCheckpoint(f"{DCP_METADATA} does not load ({load_failure(error)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict) \
            or not isinstance(metadata.state_dict_metadata, dict):
        raise InvalidCheckpoint(f"{DCP_METADATA} holds a {type(metadata).__name__}, not DCP's metadata")
    try:
        for info in metadata.storage_data.values():
            if not isinstance(info, _StorageInfo) or not is_plain_name(str(info.relative_path)):
                where = getattr(info, "relative_path", info)
                raise InvalidCheckpoint(f"{DCP_METADATA} places an item in {where!r}, not a file of the checkpoint "
                                        f"folder")
            if info.transform_descriptors:
                raise InvalidCheckpoint(f"{DCP_METADATA}: items written through DCP extensions ("
                                        f"{', '.join(map(str, info.transform_descriptors))}), which this trainer "
                                        f"does not read")
            if int(info.offset) < 0 or int(info.length) < 0:
                raise InvalidCheckpoint(f"{DCP_METADATA} places an item at a negative offset or length")
        for key, value in metadata.state_dict_metadata.items():
            if isinstance(value, TensorStorageMetadata):
                _check_chunks(str(key), value, metadata.storage_data)
    except InvalidCheckpoint:
        raise
    except Exception as error:  # noqa: BLE001 - fields of the wrong types: a foreign or damaged file
        raise InvalidCheckpoint(f"{DCP_METADATA} does not have DCP's layout ({load_failure(error)})") from None
    return metadata


def _check_chunks(key: str, value: TensorStorageMetadata, storage_data: dict[Any, Any]) -> None:
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


def folder_metadata(storage: CheckpointStorage, folder: str, manifest: dict[str, Any] | None) -> Metadata:
    """A DCP folder's metadata, read restricted: checked against its manifest where it is one of ours (None:
    another tool's folder, which has none)."""
    return read_metadata(checked_read(storage, folder, DCP_METADATA, manifest) if manifest is not None
                         else storage.read(folder, DCP_METADATA))


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
        except Exception as error:  # noqa: BLE001 - DCP sends it to every rank: one line, picklable
            raise error if isinstance(error, InvalidCheckpoint) else InvalidCheckpoint(load_failure(error)) from None
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
        error, targets, reader, stops = None, {}, None, False
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
            error, stops = str(problem), True
        except OSError as problem:
            error = f"{self.folder} unreadable ({problem.strerror or problem})"
        agree(None if alone else self.group, error, stops)
        assert reader is not None
        try:
            with _quiet_when(alone):
                dcp.load(targets, storage_reader=reader, planner=DefaultLoadPlanner(flatten_state_dict=False),
                         process_group=None if alone else self.group, no_dist=alone)
        except CheckpointException as failed:
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


class RankFailed(Exception):
    """A DCP save that failed on some rank, as every rank learns it: which rank, and its error."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(rank, error)
        self.rank, self.error = rank, error


def first_failure(failed: CheckpointException, rank: int) -> tuple[int, BaseException]:
    """DCP reports every rank's failure at once, each with its traceback: the lowest rank's error is the one to
    say (``rank``'s own when the report names none)."""
    failures = failed.failures or {}
    if not failures:
        return rank, failed
    lowest = min(failures)
    error, _ = failures[lowest]
    return lowest, error


def failure_line(failed: CheckpointException) -> str:
    """A failed DCP load in one line: the reader's own message, or the first failing rank's error."""
    rank, error = first_failure(failed, 0)
    if isinstance(error, InvalidCheckpoint):
        return str(error)
    return f"rank {rank} could not read its part of the checkpoint ({load_failure(error)})"  # type: ignore[arg-type]
