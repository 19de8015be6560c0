"""The whole-state file, ``state.pt``: every part of an unsharded checkpoint (formats 2 and 3), and the non-tensor
parts of a sharded one. Written by ``torch.save`` (trainer.checkpoint.manager), read with ``weights_only=True``.

Read without holding it whole: a local file is checked in pieces and mapped into memory (``mmap``: its pages are
read when touched, shared between the processes of a node, and given back under pressure); an object store's is
downloaded in pieces, through its checksum, to a temporary file that is mapped the same way: for a resume, one file
per node, downloaded by the first rank of the node to ask (trainer.checkpoint.node_copy).

A resume does not send the state from rank 0 to the others: rank 0 checks the file and sends the state with each
tensor replaced by a marker (``without_tensors``); every rank then maps the file itself and copies out only what it
holds (``StateFileSource``): its rows of each tensor under --sync fsdp, the whole tensors under ddp.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import torch
import torch.distributed as dist

from trainer.checkpoint import node_copy
from trainer.checkpoint.reading import (
    STATE_FILE,
    InvalidCheckpoint,
    agree,
    check_size,
    checked_pieces,
    expected,
    load_failure,
)
from trainer.checkpoint.save_failures import is_transient
from trainer.checkpoint.schema import SchemaError, TrainingState
from trainer.checkpoint.shards import MARK, marker_for, replace_tensors
from trainer.checkpoint.storage import CheckpointStorage
from trainer.errors import CheckpointError

__all__ = ["NodeCopies", "StateFileSource", "load_state_file", "without_tensors"]


@dataclass
class NodeCopies:
    """The node's copies of an object store's files that one resume (``resume``: its token) maps."""

    resume: str
    paths: list[str] = field(default_factory=list)


def load_state_file(storage: CheckpointStorage, name: str, manifest: dict[str, Any], version: int,
                    checksum: bool = True, node_copies: NodeCopies | None = None) -> TrainingState:
    """The checkpoint's state file as a TrainingState (its tensors mapped from a local file). ``checksum``: False
    where another rank checked the same file already (only its size is then checked). ``node_copies``: where an
    object store's file is downloaded once per node for the ranks of one resume, its path added there for the
    caller to release once every rank has mapped it."""
    with _mappable(storage, name, manifest, checksum, node_copies) as path:
        try:
            # weights_only: a checkpoint on shared storage must not be able to run code when loaded.
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # noqa: BLE001 - any unpickling failure means the same: unusable
            raise InvalidCheckpoint(f"{STATE_FILE} does not load with weights_only=True ({load_failure(error)})"
                                    ) from None
    if not isinstance(state, dict):
        raise InvalidCheckpoint(f"{STATE_FILE} holds a {type(state).__name__}, not a training state")
    try:
        return TrainingState.from_dict(state, version)
    except SchemaError as problem:
        raise InvalidCheckpoint(str(problem)) from None


@contextlib.contextmanager
def _mappable(storage: CheckpointStorage, name: str, manifest: dict[str, Any], checksum: bool,
              node_copies: NodeCopies | None) -> Iterator[str]:
    """A local path of the state file, checked: the file itself on a local or mounted file system; from an object
    store, a temporary copy downloaded in pieces through the checksum (never the whole file in memory), removed
    once mapped (the mapping keeps it readable), or with ``node_copies`` the node's copy."""
    local = storage.local_path(name, STATE_FILE)
    if local is not None:
        if checksum:
            checked_pieces(storage, name, STATE_FILE, manifest)
        else:
            check_size(storage, name, STATE_FILE, expected(manifest, STATE_FILE)[0])
        yield local
        return
    size, crc = expected(manifest, STATE_FILE)
    check_size(storage, name, STATE_FILE, size)

    def download(copy: IO[bytes]) -> None:
        def keep(piece: bytes) -> None:
            try:
                copy.write(piece)
            except OSError as error:  # this machine's disk, not the checkpoint: never a reason to skip it
                raise _no_local_copy(error) from None

        checked_pieces(storage, name, STATE_FILE, manifest, keep)

    if node_copies is not None:
        shared = node_copy.copy_path(node_copy.copy_key(storage.location, name, STATE_FILE, str(size), crc,
                                                        node_copies.resume))
        if shared is not None:
            node_copies.paths.append(shared)  # released by the caller, whatever happens here
            try:
                node_copy.fetch(shared, size, download)
            except OSError as error:
                raise _no_local_copy(error) from None
            yield shared
            return
    try:
        # In this user's folder where there is one: what a killed process left there goes a day later.
        descriptor, path = tempfile.mkstemp(prefix=node_copy.PREFIX, suffix=".pt", dir=node_copy.private_folder())
    except OSError as error:
        raise _no_local_copy(error) from None
    try:
        with os.fdopen(descriptor, "wb") as copy:
            download(copy)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _no_local_copy(error: OSError) -> CheckpointError:
    """A local temporary copy that cannot be made: a fault of this machine (its disk is full, TMPDIR read-only),
    which stops the resume rather than skip a good checkpoint and start afresh."""
    return CheckpointError(f"cannot copy the checkpoint's {STATE_FILE} to a local temporary file in "
                           f"{tempfile.gettempdir()} ({error.strerror or error}); point TMPDIR at a folder with room "
                           f"for it")


def without_tensors(value: Any) -> Any:
    """``value`` with each tensor replaced by a marker: its place in the state (a list of keys), shape, type, and
    whether a 4-D one was laid out channels-last (trainer.gpu.checkpoint_layout reads it)."""
    def mark(tensor: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        found = marker_for(list(path), tensor)
        if tensor.dim() == 4 and not tensor.is_contiguous():
            found["channels_last"] = tensor.is_contiguous(memory_format=torch.channels_last)
        return found

    return replace_tensors(value, mark)


class StateFileSource:
    """The tensors of a state file, for the markers ``without_tensors`` left: this rank checks the file's checksum
    in pieces and maps it, and copies out what it is asked for, its rows or a whole tensor. Copies, never views
    of the mapping: a file on a network file system may be removed (pruned) while this run still trains."""

    def __init__(self, storage: CheckpointStorage, name: str, manifest: dict[str, Any], version: int,
                 group: Any = None, resume: str = "") -> None:
        self.storage, self.name, self.manifest, self.version = storage, name, manifest, version
        self.group = group  # every rank's, for ``prepare``
        self.resume = resume  # the resume's token (LoadedCheckpoint): its ranks on a node share one download
        self._parts: dict[str, Any] | None = None

    def prepare(self, wanted: Any) -> None:
        """Map the file, on every rank at once (a collective over ``group``): a node's ranks share one download of
        an object store's file, removed once every rank has it mapped (or failed), whatever failed where."""
        if self._parts is not None:
            return
        copies = NodeCopies(self.resume) if self.resume else None
        error, stops, transient = None, False, False
        try:
            try:
                self._parts = self._load(copies)
            except InvalidCheckpoint as problem:
                error = str(problem)
            except CheckpointError as problem:  # this machine's fault (its disk) or the storage's: the resume stops
                error, stops, transient = str(problem), True, is_transient(problem)
            except Exception as problem:  # noqa: BLE001 - a storage client's own (botocore's, aiohttp's): stops
                error, stops = f"{STATE_FILE} unreadable ({' '.join(str(problem).split())[:300]})", True
                transient = is_transient(problem)
            if error and self.group is not None:
                error = f"rank {dist.get_rank()}: {error}"
            # A rank that failed alone fails every rank, never leaving them waiting.
            agree(self.group, error, stops, transient)
        finally:
            for path in copies.paths if copies else []:
                node_copy.release(path)

    def _load(self, node_copies: NodeCopies | None) -> dict[str, Any]:
        # Checked again here, by every rank: a rank whose --checkpoint-dir is another folder (a node's own disk,
        # a stale network mount) would otherwise train from other values than rank 0 checked.
        try:
            return load_state_file(self.storage, self.name, self.manifest, self.version, node_copies=node_copies).parts
        except InvalidCheckpoint as problem:
            raise InvalidCheckpoint(f"{problem} as this rank reads it, and rank 0 found it whole: every rank "
                                    f"reads the checkpoint itself, so --checkpoint-dir must be one folder that "
                                    f"every node reaches") from None

    def rows(self, marker: dict[str, Any], first: int, count: int) -> torch.Tensor:
        return self._at(marker)[first:first + count].clone()

    def whole(self, marker: dict[str, Any]) -> torch.Tensor:
        return self._at(marker).clone()

    def _at(self, marker: dict[str, Any]) -> torch.Tensor:
        if self._parts is None:  # not prepared (one process reading alone): a copy of its own, no collective
            self._parts = self._load(None)
        value: Any = self._parts
        for key in marker[MARK]:
            value = value[key]
        if not isinstance(value, torch.Tensor):
            raise InvalidCheckpoint(f"{STATE_FILE} holds no tensor at {'/'.join(map(str, marker[MARK]))}")
        return value

    def close(self) -> None:
        self._parts = None
