"""Checkpoints in a local (or mounted) folder: an atomic rename commits a checkpoint."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from trainer.checkpoint.storage.base import CheckpointStorage, NotAFile, remaining
from trainer.checkpoint.storage.names import TEMP_PREFIX, set_aside
from trainer.errors import CheckpointError


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


class LocalStorage(CheckpointStorage):
    @classmethod
    def handles(cls, location: str) -> bool:
        return "://" not in location or location.startswith("file://")

    def __init__(self, location: str) -> None:
        super().__init__(location)
        self.root = Path(location.removeprefix("file://"))

    def _list(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return [entry.name for entry in self.root.iterdir() if entry.is_dir()]

    def _make_folder(self, name: str) -> None:
        (self.root / name).mkdir(parents=True)

    @contextlib.contextmanager
    def _create(self, name: str, filename: str) -> Iterator[IO[bytes]]:
        with open(self.root / name / filename, "xb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())

    def _commit(self, temporary: str, name: str) -> None:
        fsync_dir(self.root / temporary)  # its entries first, or the renamed folder may come back empty
        final = self.root / name
        if final.exists():
            # A checkpoint of the same step is there (a broken one, or one from before a --resume PATH
            # to an older step). rename() cannot replace a non-empty folder, so it is moved aside
            # first; remove_temporaries() puts it back if a crash comes before the new one is in place.
            aside = set_aside(name)
            os.rename(final, self.root / aside)
            os.rename(self.root / temporary, final)
            fsync_dir(self.root)
            shutil.rmtree(self.root / aside, ignore_errors=True)
        else:
            os.rename(self.root / temporary, final)
            fsync_dir(self.root)

    def _rename(self, name: str, new_name: str) -> None:
        os.rename(self.root / name, self.root / new_name)
        fsync_dir(self.root)

    def read(self, name: str, filename: str) -> bytes:
        self.size(name, filename)  # a link or a FIFO is refused, not followed or waited on
        with open(self.root / name / filename, "rb", opener=_no_follow) as handle:
            return handle.read()

    def local_path(self, name: str, filename: str) -> str | None:
        return str(self.root / name / filename)

    def read_range(self, name: str, filename: str, offset: int, length: int) -> bytes:
        self.size(name, filename)
        descriptor = _no_follow(str(self.root / name / filename), os.O_RDONLY)
        try:
            pieces, done = [], 0
            while done < length:  # pread may return less than asked (a signal, a network file system)
                piece = os.pread(descriptor, length - done, offset + done)
                if not piece:
                    break
                pieces.append(piece)
                done += len(piece)
            return b"".join(pieces)
        finally:
            os.close(descriptor)

    reads_into = True

    def read_range_into(self, name: str, filename: str, offset: int, buffers: list[memoryview]) -> int:
        # One preadv straight into the buffers (a tensor's memory): no bytes object in between to copy from.
        self.size(name, filename)
        descriptor = _no_follow(str(self.root / name / filename), os.O_RDONLY)
        total = sum(len(buffer) for buffer in buffers)
        try:
            done = 0
            while done < total:  # preadv may return less than asked (a signal, a network file system)
                got = os.preadv(descriptor, remaining(buffers, done), offset + done)
                if not got:
                    break
                done += got
            return done
        finally:
            os.close(descriptor)

    def size(self, name: str, filename: str) -> int:
        info = os.lstat(self.root / name / filename)
        if not stat.S_ISREG(info.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
            raise NotAFile(f"{filename} is {kind}; a checkpoint folder holds only the files the trainer wrote")
        return info.st_size

    def exists(self, name: str, filename: str) -> bool:
        return (self.root / name / filename).is_file()

    def has_folder(self, name: str) -> bool:
        return (self.root / name).is_dir()

    def remove(self, name: str) -> None:
        # Renamed out of sight first: a crash halfway through rmtree must not leave a step folder that
        # has lost its state file but kept its manifest.
        doomed = name if name.startswith(TEMP_PREFIX) else f"{TEMP_PREFIX}removed-{name}-{uuid.uuid4().hex[:8]}"
        if doomed != name:
            os.rename(self.root / name, self.root / doomed)
        shutil.rmtree(self.root / doomed)

    def check_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f"{TEMP_PREFIX}probe-{uuid.uuid4().hex[:8]}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except (FileExistsError, NotADirectoryError):
            raise CheckpointError(f"checkpoint folder {self.root} cannot be created: a file is in the way on that "
                                  f"path; choose another --checkpoint-dir or move the file") from None
        except PermissionError as error:
            raise CheckpointError(
                f"checkpoint folder {self.root} is not writable ({error.strerror or error}): "
                f"{_who_may_write(self.root)}; give this user write access there (a Kubernetes file share: "
                f"docs/kubernetes.md, Storage) or choose another --checkpoint-dir"
            ) from None
        except OSError as error:
            raise CheckpointError(
                f"checkpoint folder {self.root} is not writable ({error.strerror or error}); "
                f"choose another --checkpoint-dir or fix its permissions"
            ) from None

    def create_exclusive(self, name: str, filename: str, data: bytes) -> bool:
        # Written whole under a private name, then linked to the final one: link() fails if that exists
        # (atomic on local disks and NFS alike), and no reader ever sees the file half-written.
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        draft = self._write_draft(folder, filename, data)
        try:
            os.link(draft, folder / filename)
            fsync_dir(folder)
            return True
        except FileExistsError:
            return False
        finally:
            draft.unlink()

    def replace_file(self, name: str, filename: str, data: bytes) -> None:
        folder = self.root / name
        draft = self._write_draft(folder, filename, data)
        os.replace(draft, folder / filename)
        fsync_dir(folder)

    @staticmethod
    def _write_draft(folder: Path, filename: str, data: bytes) -> Path:
        """The file's content, whole and durable, under a private temporary name beside it."""
        draft = folder / f"{TEMP_PREFIX}{filename}-{uuid.uuid4().hex[:8]}"
        with open(draft, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        return draft

    def files(self, name: str) -> list[str]:
        folder = self.root / name
        if not folder.is_dir():
            return []
        # Whatever the entry is: a folder or a link under a file's name is for the caller to refuse, not to miss.
        return [entry.name for entry in folder.iterdir() if not entry.name.startswith(TEMP_PREFIX)]

    def remove_file(self, name: str, filename: str) -> None:
        (self.root / name / filename).unlink(missing_ok=True)



def fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _who_may_write(folder: Path) -> str:
    """Who this process is, against the owner and mode of the nearest folder on the way that exists: what a refused
    write needs to be fixed (a share mounted with another owner is the usual cause, where fsGroup is not applied)."""
    who = f"this process runs as uid {os.getuid()}, gid {os.getgid()}"
    path = folder
    while True:
        try:
            info = path.stat()
            break
        except FileNotFoundError:
            if path == path.parent:
                return who
            path = path.parent
        except OSError:  # a folder on the way that this user may not enter
            return f"{who}, which may not enter {path.parent}"
    return (f"{who} (groups {', '.join(map(str, os.getgroups())) or 'none more'}), and {path} is owned by uid "
            f"{info.st_uid}, gid {info.st_gid}, mode {stat.S_IMODE(info.st_mode):o}")
