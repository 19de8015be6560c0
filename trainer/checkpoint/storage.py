"""Where checkpoints live: a local folder or any fsspec URL, written so that a crash never leaves a
folder that looks complete.

A checkpoint is a folder ``step-00000123`` holding ``state.pt`` and ``manifest.json``. It is
written under a temporary name, every file flushed and fsynced, the manifest (with checksums)
last, then renamed into place. Readers ignore temporaries and anything without a valid manifest.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from pathlib import Path

from trainer.errors import CheckpointError

CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})$")
TEMP_PREFIX = ".tmp-"
MANIFEST = "manifest.json"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    match = CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


class CheckpointStorage(ABC):
    """The seam between the checkpoint logic and a file system."""

    def __init__(self, location: str) -> None:
        self.location = location

    def describe(self, name: str = "") -> str:
        return f"{self.location.rstrip('/')}/{name}" if name else self.location

    def list_checkpoints(self) -> list[str]:
        """Checkpoint folder names, newest step first (validity is the manager's business)."""
        names = [name for name in self._list() if step_of(name) is not None]
        return sorted(names, key=lambda name: step_of(name) or 0, reverse=True)

    def write(self, name: str, files: dict[str, bytes], manifest: bytes) -> None:
        """Write the files, then the manifest, then make the folder appear under ``name`` in one step."""
        temporary = f"{TEMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        try:
            self._write_folder(temporary, {**files, MANIFEST: manifest})
            self._commit(temporary, name)
        except OSError as error:
            self._remove_quietly(temporary)
            raise CheckpointError(
                f"could not write checkpoint {self.describe(name)}: {error.strerror or error}. The previous "
                f"checkpoints are untouched; free space or fix permissions on {self.location}"
            ) from None

    def remove_temporaries(self) -> list[str]:
        """Delete folders left by saves that crashed; they never held a usable checkpoint."""
        stale = [name for name in self._list() if name.startswith(TEMP_PREFIX)]
        for name in stale:
            self._remove_quietly(name)
        return stale

    def _remove_quietly(self, name: str) -> None:
        with contextlib.suppress(OSError):
            self.remove(name)

    @abstractmethod
    def _list(self) -> list[str]: ...

    @abstractmethod
    def _write_folder(self, name: str, files: dict[str, bytes]) -> None: ...

    @abstractmethod
    def _commit(self, temporary: str, name: str) -> None: ...

    @abstractmethod
    def read(self, name: str, filename: str) -> bytes: ...

    @abstractmethod
    def exists(self, name: str, filename: str) -> bool: ...

    @abstractmethod
    def remove(self, name: str) -> None: ...

    @abstractmethod
    def check_writable(self) -> None:
        """Raise CheckpointError now, at start, rather than after an epoch of training."""


class LocalStorage(CheckpointStorage):
    def __init__(self, location: str) -> None:
        super().__init__(location)
        self.root = Path(location.removeprefix("file://"))

    def _list(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return [entry.name for entry in self.root.iterdir() if entry.is_dir()]

    def _write_folder(self, name: str, files: dict[str, bytes]) -> None:
        folder = self.root / name
        folder.mkdir(parents=True)
        for filename, data in files.items():
            with open(folder / filename, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        _fsync_dir(folder)

    def _commit(self, temporary: str, name: str) -> None:
        final = self.root / name
        if final.exists():
            # Only a broken checkpoint of the same step can be here (the manager never saves a step
            # twice); move it aside first because rename() cannot replace a non-empty folder.
            aside = self.root / f"{TEMP_PREFIX}replaced-{name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, aside)
            os.rename(self.root / temporary, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(self.root / temporary, final)
        _fsync_dir(self.root)

    def read(self, name: str, filename: str) -> bytes:
        return (self.root / name / filename).read_bytes()

    def exists(self, name: str, filename: str) -> bool:
        return (self.root / name / filename).is_file()

    def remove(self, name: str) -> None:
        shutil.rmtree(self.root / name)

    def check_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f"{TEMP_PREFIX}probe-{uuid.uuid4().hex[:8]}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as error:
            raise CheckpointError(
                f"checkpoint folder {self.root} is not writable ({error.strerror or error}); "
                f"choose another --checkpoint-dir or fix its permissions"
            ) from None


class FsspecStorage(CheckpointStorage):
    """Object stores have no atomic folder rename: the manifest, written last and checked against the
    files' checksums, is what commits a checkpoint there."""

    def __init__(self, location: str) -> None:
        super().__init__(location)
        try:
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(location)
        except (ImportError, ValueError) as error:
            raise CheckpointError(
                f"--checkpoint-dir {location}: no filesystem for this URL ({error}); install the fsspec "
                f"package for its scheme (for example s3fs for s3://)"
            ) from None
        self.root = self.root.rstrip("/")

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _list(self) -> list[str]:
        if not self.fs.exists(self.root):
            return []
        entries = self.fs.ls(self.root, detail=True)
        return [entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries if entry["type"] == "directory"]

    def _write_folder(self, name: str, files: dict[str, bytes]) -> None:
        self.fs.makedirs(self._path(name), exist_ok=True)
        for filename, data in files.items():
            self.fs.pipe_file(self._path(name, filename), data)

    def _commit(self, temporary: str, name: str) -> None:
        if self.fs.exists(self._path(name)):
            self.fs.rm(self._path(name), recursive=True)
        self.fs.mv(self._path(temporary), self._path(name), recursive=True)

    def read(self, name: str, filename: str) -> bytes:
        return self.fs.cat_file(self._path(name, filename))

    def exists(self, name: str, filename: str) -> bool:
        return self.fs.exists(self._path(name, filename))

    def remove(self, name: str) -> None:
        self.fs.rm(self._path(name), recursive=True)

    def check_writable(self) -> None:
        probe = self._path(f"{TEMP_PREFIX}probe-{uuid.uuid4().hex[:8]}")
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm(probe)
        except Exception as error:  # fsspec backends raise their own exception types
            raise CheckpointError(
                f"checkpoint location {self.location} is not writable ({error}); check the URL and credentials"
            ) from None


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def open_storage(location: str) -> CheckpointStorage:
    if "://" not in location or location.startswith("file://"):
        return LocalStorage(location)
    return FsspecStorage(location)
