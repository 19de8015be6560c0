"""Where checkpoints live: one module per backend behind the interface of ``base``.

A new backend is a module here with a ``CheckpointStorage`` subclass whose ``handles(location)`` says which
locations it serves, named in ``BACKENDS``: the first that handles a location opens it.
"""

from __future__ import annotations

from trainer.checkpoint.storage.base import (
    MANIFEST,
    CheckpointStorage,
    FileWriter,
    ManifestMaker,
    NotAFile,
)
from trainer.checkpoint.storage.checksum import ChecksumWriter, crc32_hex
from trainer.checkpoint.storage.fsspec_backend import EXCLUSIVE_CREATE_SINCE, FsspecStorage
from trainer.checkpoint.storage.local import LocalStorage
from trainer.checkpoint.storage.names import checkpoint_name, saved_in_place, step_of

__all__ = ["BACKENDS", "EXCLUSIVE_CREATE_SINCE", "MANIFEST", "CheckpointStorage", "ChecksumWriter", "FileWriter",
           "FsspecStorage", "LocalStorage", "ManifestMaker", "NotAFile", "checkpoint_name", "crc32_hex",
           "open_storage", "saved_in_place", "step_of"]

# Most specific first: a local path (or file://) before any other URL, which fsspec resolves.
BACKENDS: tuple[type[CheckpointStorage], ...] = (LocalStorage, FsspecStorage)


def open_storage(location: str) -> CheckpointStorage:
    backend = next(backend for backend in BACKENDS if backend.handles(location))
    return backend(location)
