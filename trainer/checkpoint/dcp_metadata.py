"""DCP's ``.metadata`` (which chunk of which tensor lies where), read without running any code of the file's choosing.

``.metadata`` is a pickle, and torch's own reader loads it with ``pickle.load``: a DCP folder can run code when
loaded. It is read here by an unpickler that admits DCP's metadata types only, and refuses anything else in one
line; a file it names outside the folder, or items written through DCP's stream extensions, are refused, and each
tensor's chunks are checked to cover it exactly once (trainer.checkpoint.dcp_chunks).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
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

from trainer.checkpoint.dcp_chunks import check_chunks
from trainer.checkpoint.reading import DCP_METADATA, InvalidCheckpoint, checked_read, is_plain_name, load_failure
from trainer.checkpoint.storage import CheckpointStorage

__all__ = ["folder_metadata", "read_metadata"]


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

# DCP's records, the only objects whose fields the metadata may set.
_RECORDS = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
            MetadataIndex, StorageMeta, _StorageInfo)


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
                check_chunks(str(key), value, metadata.storage_data)
    except InvalidCheckpoint:
        raise
    except Exception as error:  # noqa: BLE001 - fields of the wrong types: a foreign or damaged file
        raise InvalidCheckpoint(f"{DCP_METADATA} does not have DCP's layout ({load_failure(error)})") from None
    return metadata



def folder_metadata(storage: CheckpointStorage, folder: str, manifest: dict[str, Any] | None) -> Metadata:
    """A DCP folder's metadata, read restricted: checked against its manifest where it is one of ours (None:
    another tool's folder, which has none)."""
    return read_metadata(checked_read(storage, folder, DCP_METADATA, manifest) if manifest is not None
                         else storage.read(folder, DCP_METADATA))
