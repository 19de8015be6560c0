"""``--init-from PATH``: a fresh run starts from the model weights of a torch.distributed.checkpoint folder,
written by this trainer or another tool (TorchTitan keeps the model's tensors at the top level, by name; this
trainer under ``model.``), read through the same restricted reader as a resume (trainer.checkpoint.dcp_reader):
its ``.metadata`` admits DCP's own types only, and each rank reads only the chunks its shards need.

The weights only: the optimizer, the schedule and the position start afresh. A checkpoint that lacks a tensor
of this model, or holds one of another shape, is refused in one line naming them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from trainer.checkpoint.dcp_metadata import folder_metadata
from trainer.checkpoint.dcp_reader import DcpSource
from trainer.checkpoint.reading import DCP_METADATA, InvalidCheckpoint, UnknownFormat, agree, read_manifest
from trainer.checkpoint.save_failures import is_transient
from trainer.checkpoint.shards import fit, marker_for
from trainer.checkpoint.storage import MANIFEST, open_storage
from trainer.errors import CheckpointError, StorageUnavailable
from trainer.redact import redact

__all__ = ["initial_weights"]

# Where a tool keeps a model's tensors among the checkpoint's keys, in the order they are tried.
PREFIXES = ("", "model.")


def initial_weights(path: str, model: nn.Module, group: Any) -> str:
    """Load the weights of the DCP folder at ``path`` into ``model`` (its own shards under --sync fsdp), on every
    rank at once (a collective read over ``group``); returns what was loaded, for the log."""
    try:
        return _load(path, model, group)
    except StorageUnavailable as problem:  # the storage did not answer: exit 200, retried
        raise StorageUnavailable(redact(f"--init-from {path}: {problem}", path)) from None
    except (InvalidCheckpoint, UnknownFormat) as problem:
        raise CheckpointError(f"--init-from {path}: {problem}; pass a torch.distributed.checkpoint folder of this "
                              f"model") from None
    except OSError as error:
        raise CheckpointError(redact(f"--init-from {path}: cannot read it ({error.strerror or error})", path)) from None


def _match(storage: Any, name: str, wanted: dict[str, Any]
           ) -> tuple[dict[str, Any] | None, Metadata, str, dict[str, TensorStorageMetadata]]:
    """The folder's manifest (one of ours) or None (another tool's), its metadata, the prefix under which it keeps
    the model's tensors, and its tensors; InvalidCheckpoint when it lacks one of the model's or holds one of
    another shape."""
    if not storage.exists(name, DCP_METADATA):
        raise InvalidCheckpoint(f"no {DCP_METADATA} there (not a torch.distributed.checkpoint folder)")
    # One of ours: its files checked against its manifest and items.json; another tool's: sizes only.
    manifest = read_manifest(storage, name)[0] if storage.exists(name, MANIFEST) else None
    metadata = folder_metadata(storage, name, manifest)
    saved = {key: value for key, value in metadata.state_dict_metadata.items()
             if isinstance(value, TensorStorageMetadata)}
    prefix = max(PREFIXES, key=lambda candidate: sum(f"{candidate}{key}" in saved for key in wanted))
    missing = [key for key in wanted if f"{prefix}{key}" not in saved]
    if missing:
        held = ", ".join(sorted(saved)[:5]) or "no tensors"
        raise InvalidCheckpoint(f"it has no tensor for {len(missing)} of the model's {len(wanted)} (such as "
                                f"{', '.join(missing[:5])}); it holds {held}{', ...' if len(saved) > 5 else ''}")
    reshaped = [f"{key} {list(saved[prefix + key].size)} where the model has {list(tensor.shape)}"
                for key, tensor in wanted.items() if list(saved[prefix + key].size) != list(tensor.shape)]
    if reshaped:
        raise InvalidCheckpoint(f"its tensors do not fit the model: {'; '.join(reshaped[:3])}")
    return manifest, metadata, prefix, saved


def _load(path: str, model: nn.Module, group: Any) -> str:
    parent, _, name = path.rstrip("/").rpartition("/")
    storage = open_storage(parent or ".")
    wanted = model.state_dict()
    error: str | None = None
    stops = transient = False
    manifest, metadata, prefix, saved = None, None, "", {}
    try:  # what each rank reads alone, agreed on before the collective read
        manifest, metadata, prefix, saved = _match(storage, name, wanted)
    except InvalidCheckpoint as problem:
        error = str(problem)
    except CheckpointError as problem:  # the storage did not answer (StorageUnreadable): exit 200 where a retry may
        error, stops, transient = str(problem), True, is_transient(problem)
    except OSError as problem:
        error, stops, transient = f"cannot read it ({problem.strerror or problem})", True, is_transient(problem)
    agree(group, error, stops, transient)
    markers = {key: marker_for(f"{prefix}{key}", tensor) for key, tensor in wanted.items()}
    source = DcpSource(storage, name, manifest, group, metadata=metadata)
    try:
        source.prepare([(marker, wanted[key]) for key, marker in markers.items()])
        model.load_state_dict(fit(markers, wanted, source))
    finally:
        source.close()
    unused = len(saved) - len(wanted)
    elements = sum(int(torch.Size(tensor.shape).numel()) for tensor in wanted.values())
    return (f"{len(wanted)} tensors ({elements:,} values) from {repr(prefix) + ' keys' if prefix else 'its top level'}"
            + (f"; {unused} other tensors of the checkpoint left (an optimizer's, ...)" if unused else ""))
