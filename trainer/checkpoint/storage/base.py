"""The seam between the checkpoint logic and a file system: how a checkpoint folder is written so that a
crash never leaves one that looks complete, and what every backend provides.

A checkpoint is a folder ``step-00000123`` holding ``state.pt`` and ``manifest.json``. It is
written under a temporary name, every file streamed through a checksum and fsynced, the manifest
(with sizes and checksums) last, then renamed into place. Readers ignore temporaries and anything
without a valid manifest.

Where a folder cannot be renamed at once (an object store moves it object by object), each save writes a
folder of its own, ``step-00000123.<save>``, and its manifest, written last, is the commit: no two saves ever
share an object name, so one save can neither write into nor remove another's (``commits_in_place``). The
names are trainer.checkpoint.storage.names's.
"""

from __future__ import annotations

import contextlib
import errno
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import IO, Any

from trainer.checkpoint.save_failures import is_transient
from trainer.checkpoint.storage.checksum import ChecksumWriter
from trainer.checkpoint.storage.names import (
    TEMP_PREFIX,
    in_place_name,
    newest_first,
    set_aside_from,
    step_of,
    temporary_name,
)
from trainer.errors import CheckpointError, StorageUnavailable

MANIFEST = "manifest.json"


FileWriter = Callable[[IO[bytes]], None]  # writes one file's content into an open binary handle
ManifestMaker = Callable[[dict[str, dict[str, Any]]], bytes]  # {filename: {"bytes", "crc32"}} -> manifest


class NotAFile(ValueError):
    """A checkpoint's file that is a link, a FIFO or a device: never read (it could block, or lead elsewhere)."""


class CheckpointStorage(ABC):
    """The seam between the checkpoint logic and a file system."""

    # Whether a save writes straight into a folder of its own (``step-N.<save>``) and its manifest is the commit,
    # rather than into a temporary folder renamed into place: where a rename is no atomic operation.
    commits_in_place = False

    def __init__(self, location: str) -> None:
        self.location = location

    @classmethod
    @abstractmethod
    def handles(cls, location: str) -> bool:
        """Whether this backend serves ``location`` (trainer.checkpoint.storage.BACKENDS asks in order)."""

    def describe(self, name: str = "") -> str:
        return f"{self.location.rstrip('/')}/{name}" if name else self.location

    def reason(self, error: OSError) -> str:
        """An OSError's words for a message. A file system's own paths may hold what the location's URL
        carried (a memory:// or local path with "user:password@" in it): they are shown as the location,
        which every message redacts."""
        return str(error.strerror or error)

    def list_checkpoints(self) -> list[str]:
        """Checkpoint folder names, newest step first (validity is the manager's business)."""
        names = [name for name in self._list() if step_of(name) is not None]
        return sorted(names, key=newest_first, reverse=True)

    def write(self, name: str, files: dict[str, FileWriter], make_manifest: ManifestMaker) -> str:
        """Stream the files, then the manifest describing them, then make the folder appear under ``name``; the
        committed folder's name (``commit``)."""
        return self.commit(self.begin(name), name, files, {}, make_manifest)

    def begin(self, name: str, generation: int = 0) -> str:
        """A new folder for checkpoint ``name``, which several processes may write files into (``write_file``)
        before one of them commits it: a temporary one, or under ``commits_in_place`` the save's own, named after
        the saving job's lease ``generation`` (trainer.checkpoint.storage.names)."""
        temporary = in_place_name(name, generation) if self.commits_in_place else temporary_name(name)
        try:
            self._make_folder(temporary)
        except OSError as error:
            raise self._failure(name, error) from None
        return temporary

    def write_file(self, temporary: str, filename: str, write_content: FileWriter) -> dict[str, Any]:
        """Stream one file into the temporary folder through a checksum; its size and crc32, for the manifest."""
        with self._create(temporary, filename) as handle, ChecksumWriter(handle) as checksummed:
            try:
                write_content(checksummed)  # type: ignore[arg-type] - a write/flush file object
            except Exception:
                if checksummed.error is not None:
                    raise checksummed.error from None  # the cause a person can act on
                raise
        return checksummed.summary()

    def commit(self, temporary: str, name: str, files: dict[str, FileWriter], written: dict[str, dict[str, Any]],
               make_manifest: ManifestMaker) -> str:
        """Write the remaining files, then the manifest describing them and the ``written`` ones, then make the
        folder appear under ``name``; on failure the temporary folder is removed and the older ones stay. The
        committed folder's name: ``name``, or under ``commits_in_place`` the folder ``begin`` made."""
        try:
            described = dict(written)
            for filename, write_content in files.items():
                described[filename] = self.write_file(temporary, filename, write_content)
            # Made before its file is opened: an object store's file uploads what it holds when closed, even
            # by an error (an empty manifest).
            manifest = make_manifest(described)
            with self._create(temporary, MANIFEST) as handle:
                handle.write(manifest)
            if self.commits_in_place:
                return temporary
            self._commit(temporary, name)
            return name
        except OSError as error:
            self.abandon(temporary)
            raise self._failure(name, error) from None
        except Exception:  # a backend's own error, or the manager refusing to commit: no folder stays behind
            self.abandon(temporary)
            raise

    def abandon(self, temporary: str) -> None:
        """Remove the folder of a save that failed (``begin``'s)."""
        self._remove_quietly(temporary)

    def _failure(self, name: str, error: OSError) -> CheckpointError:
        said = (f"could not write checkpoint {self.describe(name)}: {self.reason(error).rstrip('.')}. The previous "
                f"checkpoints are untouched")
        if is_transient(error):  # an I/O error, a store's 5xx or throttling: the next save may work
            return StorageUnavailable(said)
        return CheckpointError(f"{said}; {_remedy(error, self.location)}")

    def remove_temporaries(self) -> list[str]:
        """Delete folders left by saves that crashed; they never held a usable checkpoint, except a
        checkpoint moved aside to be replaced when the crash came before its replacement was in place. (A save
        committed in place leaves a folder under its final name: the manager, which reads manifests, removes
        those that will never be whole.)"""
        present = set(self._list())
        stale = sorted(name for name in present if name.startswith(TEMP_PREFIX))
        for name in stale:
            original = set_aside_from(name)
            if original is not None and (original not in present or not self.exists(original, MANIFEST)):
                self._put_back(name, original)
                present.add(original)
            else:
                self._remove_quietly(name)
        return stale

    def _put_back(self, aside: str, original: str) -> None:
        """Return a checkpoint moved aside for a replacement that did not complete."""
        if self.has_folder(original):  # never a checkpoint (no manifest): a rename cannot replace a folder
            self._remove_quietly(original)
        self._rename(aside, original)

    def _remove_quietly(self, name: str) -> None:
        with contextlib.suppress(OSError):
            self.remove(name)

    @abstractmethod
    def _list(self) -> list[str]: ...

    @abstractmethod
    def _make_folder(self, name: str) -> None: ...

    @abstractmethod
    def _create(self, name: str, filename: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A new file, durable once the context exits without error."""

    @abstractmethod
    def _commit(self, temporary: str, name: str) -> None: ...

    @abstractmethod
    def _rename(self, name: str, new_name: str) -> None: ...

    @abstractmethod
    def read(self, name: str, filename: str) -> bytes: ...

    def local_path(self, name: str, filename: str) -> str | None:
        """The file's path where it is on a local (or mounted) file system, which a reader may map into memory;
        None on an object store."""
        return None

    @abstractmethod
    def read_range(self, name: str, filename: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the file from ``offset`` (fewer only where the file ends sooner)."""

    # Whether the backend reads into memory it is given (``read_range_into``: a local file); an object store's
    # reader fetches a range once (``read_range``) and copies what it needs.
    reads_into = False

    def read_range_into(self, name: str, filename: str, offset: int, buffers: list[memoryview]) -> int:
        """The bytes from ``offset`` into ``buffers``, one after the other (a tensor's memory among them); how
        many bytes it got (fewer only where the file ends sooner). Only where ``reads_into``."""
        raise NotImplementedError(f"{type(self).__name__} reads ranges with read_range")

    @abstractmethod
    def size(self, name: str, filename: str) -> int:
        """The file's size in bytes, known before reading it; NotAFile if it is no plain file."""

    @abstractmethod
    def exists(self, name: str, filename: str) -> bool: ...

    @abstractmethod
    def has_folder(self, name: str) -> bool: ...

    @abstractmethod
    def remove(self, name: str) -> None: ...

    @abstractmethod
    def check_writable(self) -> None:
        """Raise CheckpointError now, at start, rather than after an epoch of training."""

    # -- small files of the folder's own (trainer.checkpoint.lease) -----------------------------------------
    @abstractmethod
    def create_exclusive(self, name: str, filename: str, data: bytes) -> bool:
        """Create the file with this content only if it does not exist, atomically; False if it did."""

    @abstractmethod
    def replace_file(self, name: str, filename: str, data: bytes) -> None:
        """Write the file whole (readers see the old content or the new one, never a part)."""

    @abstractmethod
    def files(self, name: str) -> list[str]:
        """The names in folder ``name``, temporaries left out (none if it does not exist)."""

    @abstractmethod
    def remove_file(self, name: str, filename: str) -> None: ...



def remaining(buffers: list[memoryview], done: int) -> list[memoryview]:
    """What of ``buffers`` is left to fill once ``done`` bytes went into them, in order."""
    left = []
    for buffer in buffers:
        if done >= len(buffer):
            done -= len(buffer)
            continue
        left.append(buffer[done:])
        done = 0
    return left


def _remedy(error: OSError, location: str) -> str:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free space on {location}, lower --keep-last, or choose another --checkpoint-dir"
    return f"fix permissions on {location} or choose another --checkpoint-dir"

