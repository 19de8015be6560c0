"""The whole-state file, ``state.pt``: every part of an unsharded checkpoint (formats 2 and 3), and the non-tensor
parts of a sharded one. Written by ``torch.save`` (trainer.checkpoint.manager), read with ``weights_only=True``.

Read without holding it twice: a local file is checked in pieces and mapped into memory (``mmap``: its pages are
read when touched, shared between the processes of a node, and given back under pressure), an object store's is
downloaded. A resume does not send the state from rank 0 to the others: rank 0 checks the file and sends the state
with each tensor replaced by a marker (``without_tensors``); every rank then maps the file itself and copies out
only what it holds (``StateFileSource``): its rows of each tensor under --sync fsdp, the whole tensors under ddp.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from trainer.checkpoint.reading import STATE_FILE, InvalidCheckpoint, check_size, checked_file, load_failure
from trainer.checkpoint.schema import SchemaError, TrainingState
from trainer.checkpoint.shards import MARK
from trainer.checkpoint.storage import CheckpointStorage

__all__ = ["StateFileSource", "load_state_file", "without_tensors"]


def load_state_file(storage: CheckpointStorage, name: str, manifest: dict[str, Any], version: int,
                    checksum: bool = True) -> TrainingState:
    """The checkpoint's state file as a TrainingState (its tensors mapped from a local file). ``checksum``: False
    where another rank checked the same file already (only its size is then checked)."""
    if checksum:
        source = checked_file(storage, name, STATE_FILE, manifest)
    else:
        check_size(storage, name, STATE_FILE, int(manifest["files"][STATE_FILE]["bytes"]))
        source = storage.local_path(name, STATE_FILE) or storage.read(name, STATE_FILE)
    try:
        # weights_only: a checkpoint on shared storage must not be able to run code when loaded.
        if isinstance(source, str):
            state = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        else:
            state = torch.load(io.BytesIO(source), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unpickling failure means the same: unusable
        raise InvalidCheckpoint(f"{STATE_FILE} does not load with weights_only=True ({load_failure(error)})"
                                ) from None
    if not isinstance(state, dict):
        raise InvalidCheckpoint(f"{STATE_FILE} holds a {type(state).__name__}, not a training state")
    try:
        return TrainingState.from_dict(state, version)
    except SchemaError as problem:
        raise InvalidCheckpoint(str(problem)) from None


def without_tensors(value: Any, path: tuple[Any, ...] = ()) -> Any:
    """``value`` with each tensor replaced by a marker: its place in the state (a list of keys), shape, type, and
    whether a 4-D one was laid out channels-last (trainer.gpu.checkpoint_layout reads it)."""
    if isinstance(value, torch.Tensor):
        marker: dict[str, Any] = {MARK: list(path), "shape": list(value.shape),
                                  "dtype": str(value.dtype).removeprefix("torch.")}
        if value.dim() == 4 and not value.is_contiguous():
            marker["channels_last"] = value.is_contiguous(memory_format=torch.channels_last)
        return marker
    if isinstance(value, dict):
        return type(value)((key, without_tensors(item, (*path, key))) for key, item in value.items())
    if isinstance(value, list | tuple):
        return type(value)(without_tensors(item, (*path, index)) for index, item in enumerate(value))
    return value


class StateFileSource:
    """The tensors of a state file, for the markers ``without_tensors`` left: this rank maps the file (rank 0
    checked its checksum) and copies out what it is asked for, its rows or a whole tensor. Copies, never views
    of the mapping: a file on a network file system may be removed (pruned) while this run still trains."""

    def __init__(self, storage: CheckpointStorage, name: str, manifest: dict[str, Any], version: int) -> None:
        self.storage, self.name, self.manifest, self.version = storage, name, manifest, version
        self._parts: dict[str, Any] | None = None

    def prepare(self, wanted: Any) -> None:
        if self._parts is None:
            # The object store's download is checked here too: it is this rank's own copy of the bytes.
            checksum = self.storage.local_path(self.name, STATE_FILE) is None
            self._parts = load_state_file(self.storage, self.name, self.manifest, self.version, checksum).parts

    def rows(self, marker: dict[str, Any], first: int, count: int) -> torch.Tensor:
        return self._at(marker)[first:first + count].clone()

    def whole(self, marker: dict[str, Any]) -> torch.Tensor:
        return self._at(marker).clone()

    def _at(self, marker: dict[str, Any]) -> torch.Tensor:
        self.prepare(None)
        value: Any = self._parts
        for key in marker[MARK]:
            value = value[key]
        if not isinstance(value, torch.Tensor):
            raise InvalidCheckpoint(f"{STATE_FILE} holds no tensor at {'/'.join(map(str, marker[MARK]))}")
        return value

    def close(self) -> None:
        self._parts = None
