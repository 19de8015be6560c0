"""Finding out whether a checkpoint folder can be resumed from, before anything is restored: its manifest, its
state file, and that every other file it lists is there with its size. The tensors of a sharded checkpoint are
checked by the rank that reads them, as it reads them (trainer.checkpoint.dcp_reader): no rank reads the whole
checkpoint to check it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any

from trainer.checkpoint import shards
from trainer.checkpoint.dcp_reader import DcpSource
from trainer.checkpoint.reading import STATE_FILE, InvalidCheckpoint, check_size, checked_read, read_manifest
from trainer.checkpoint.schema import DCP_FORMAT, TrainingState
from trainer.checkpoint.state_file import StateFileSource, load_state_file, without_tensors
from trainer.checkpoint.storage import MANIFEST, CheckpointStorage, open_storage


@dataclass
class LoadedCheckpoint:
    location: str
    manifest: dict[str, Any]
    state: TrainingState
    # Where the folder is (its storage's location and its name): each rank reads its own shards there.
    folder: tuple[str, str] = ("", "")
    # The state's tensors are markers, each rank reads them from the state file (for_every_rank).
    tensors_in_state_file: bool = False
    # Drawn by rank 0 for one resume (for_every_rank): the ranks of a node share one download of the state file.
    resume: str = ""

    def for_every_rank(self) -> LoadedCheckpoint:
        """What rank 0 sends every rank: an unsharded checkpoint's state with its tensors left in the state file
        (each rank maps it and copies out what it holds: state_file.StateFileSource), never the tensors
        themselves; a sharded one's state file holds none."""
        if self.manifest.get("format") not in (2, 3):
            return self
        state = self.state
        light = TrainingState(without_tensors(state.parts), state.world_size, state.versions, state.part_versions,
                              state.per_rank, state.shards)
        return replace(self, state=light, tensors_in_state_file=True, resume=uuid.uuid4().hex)

    def shard_source(self, group: Any = None, allocate: Any = None
                     ) -> shards.ShardSource | DcpSource | StateFileSource | None:
        """Where the checkpoint's tensors are read from, each read checked: format 5's DCP files (a collective read
        over ``group``, every rank at once, each range checked by its reader), format 4's shard files, and the
        state file when the state was sent without its tensors (for_every_rank). ``allocate(shape, dtype)``: where
        DCP reads a whole tensor into (default: memory)."""
        storage, name = open_storage(self.folder[0]), self.folder[1]
        if self.manifest.get("format") == DCP_FORMAT:
            return DcpSource(storage, name, self.manifest, group, allocate)
        if self.tensors_in_state_file:
            return StateFileSource(storage, name, self.manifest, int(self.manifest["format"]), group, self.resume)
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
    state = load_state_file(storage, name, manifest, version)
    for filename, entry in manifest["files"].items():
        if filename != STATE_FILE:  # a sharded checkpoint's files: each rank checks what it reads of them
            try:
                size = int(entry["bytes"])
            except (KeyError, TypeError, ValueError):
                raise InvalidCheckpoint(f"{MANIFEST} does not describe {filename}") from None
            check_size(storage, name, filename, size)
    return LoadedCheckpoint(storage.describe(name), manifest, state, (storage.location, name))


def verify_path(path: str) -> LoadedCheckpoint:
    """``verify`` of the checkpoint at ``path``: its folder, or its state file or manifest, local or a URL."""
    folder = path.rstrip("/")
    if folder.endswith(f"/{STATE_FILE}") or folder.endswith(f"/{MANIFEST}"):
        folder = folder.rsplit("/", 1)[0]
    parent, _, name = folder.rpartition("/")
    return verify(open_storage(parent or "."), name)
