"""A sharded checkpoint's tensors written in torch.distributed.checkpoint's (DCP's) layout, through the checkpoint's
storage backend, each item checksummed on its way out.

The files are DCP's own: one ``__R_0.distcp`` per writing rank (each tensor chunk a ``torch.save`` at an offset)
and ``.metadata`` (which chunk of which tensor lies where), so a plain ``dcp.load`` reads the checkpoint folder, as
do the tools built on DCP (TorchTitan's, torchtune's, ``dcp_to_torch_save``). DCP plans the save: a chunk held by
several ranks (an HSDP replica's, a plain tensor every rank holds) is written once, by the rank with the least to
write so far, so the replicas share the writing. Keys are names: ``model.<parameter>``,
``optimizer.state.<parameter>.exp_avg`` (DCP's flattening of ``{"model": ..., "optimizer": ...}``); what is not
a tensor stays in the checkpoint's own state file. Every item's checksums (trainer.checkpoint.dcp_items) go to
``items.json``, which trainer.checkpoint.dcp_reader checks each byte range it reads against.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor

from trainer.checkpoint import dcp_items
from trainer.checkpoint.dcp_errors import RankFailed, first_failure, plain, quiet_when_alone
from trainer.checkpoint.reading import DCP_METADATA
from trainer.checkpoint.shards import marker_for, replace_tensors
from trainer.checkpoint.storage import CheckpointStorage
from trainer.sharding import local_rows

__all__ = ["Shard", "SplitState", "Written", "data_file", "save", "split"]


def data_file(rank: int) -> str:
    """The file a rank writes its items to (DCP's FileSystemWriter names it alike)."""
    return f"__{rank}_0.distcp"


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
        with quiet_when_alone(alone):
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
            raise plain(self.failed)
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
                raise plain(error) from None
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
