"""Finding out whether a checkpoint folder can be resumed from, before anything is restored: its manifest, its
state file, and that every other file it lists is there with its size. The tensors of a sharded checkpoint are
checked by the rank that reads them, as it reads them (trainer.checkpoint.dcp_files): no rank reads the whole
checkpoint to check it."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch

from trainer.checkpoint import dcp_files, shards
from trainer.checkpoint.reading import (
    STATE_FILE,
    InvalidCheckpoint,
    check_size,
    checked_read,
    load_failure,
    read_manifest,
)
from trainer.checkpoint.schema import DCP_FORMAT, SchemaError, TrainingState
from trainer.checkpoint.storage import MANIFEST, CheckpointStorage, open_storage


@dataclass
class LoadedCheckpoint:
    location: str
    manifest: dict[str, Any]
    state: TrainingState
    # Where the folder is (its storage's location and its name): each rank reads its own shards there.
    folder: tuple[str, str] = ("", "")

    def shard_source(self, group: Any = None) -> shards.ShardSource | dcp_files.DcpSource | None:
        """Where a sharded checkpoint's tensors are read from, each read checked by the rank that reads it:
        format 5's DCP files (a collective read over ``group``, every rank at once), format 4's shard files."""
        storage, name = open_storage(self.folder[0]), self.folder[1]
        if self.manifest.get("format") == DCP_FORMAT:
            return dcp_files.DcpSource(storage, name, self.manifest, group)
        if self.state.shards is None:
            return None
        return shards.ShardSource(self.state.shards, lambda filename: checked_read(storage, name, filename,
                                                                                   self.manifest))


def verify(storage: CheckpointStorage, name: str) -> LoadedCheckpoint:
    """Read one checkpoint and check it against its manifest; InvalidCheckpoint says what is wrong, in one line."""
    if not storage.exists(name, MANIFEST):
        raise InvalidCheckpoint("no manifest (the save did not finish)" if storage.has_folder(name)
                                else "no such checkpoint folder")
    manifest, version = read_manifest(storage, name)
    data = checked_read(storage, name, STATE_FILE, manifest)
    try:
        # weights_only: a checkpoint on shared storage must not be able to run code when loaded.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unpickling failure means the same: unusable
        raise InvalidCheckpoint(f"{STATE_FILE} does not load with weights_only=True ({load_failure(error)})"
                                ) from None
    if not isinstance(state, dict):
        raise InvalidCheckpoint(f"{STATE_FILE} holds a {type(state).__name__}, not a training state")
    for filename, entry in manifest["files"].items():
        if filename != STATE_FILE:  # a sharded checkpoint's files: each rank checks what it reads of them
            try:
                size = int(entry["bytes"])
            except (KeyError, TypeError, ValueError):
                raise InvalidCheckpoint(f"{MANIFEST} does not describe {filename}") from None
            check_size(storage, name, filename, size)
    try:
        return LoadedCheckpoint(storage.describe(name), manifest, TrainingState.from_dict(state, version),
                                (storage.location, name))
    except SchemaError as problem:
        raise InvalidCheckpoint(str(problem)) from None


def verify_path(path: str) -> LoadedCheckpoint:
    """``verify`` of the checkpoint at ``path``: its folder, or its state file or manifest, local or a URL."""
    folder = path.rstrip("/")
    if folder.endswith(f"/{STATE_FILE}") or folder.endswith(f"/{MANIFEST}"):
        folder = folder.rsplit("/", 1)[0]
    parent, _, name = folder.rpartition("/")
    return verify(open_storage(parent or "."), name)
