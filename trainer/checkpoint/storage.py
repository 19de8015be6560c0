"""Where checkpoints live: a local folder or any fsspec URL, written so that a crash never leaves a
folder that looks complete.

A checkpoint is a folder ``step-00000123`` holding ``state.pt`` and ``manifest.json``. It is
written under a temporary name, every file streamed through a checksum and fsynced, the manifest
(with sizes and checksums) last, then renamed into place. Readers ignore temporaries and anything
without a valid manifest.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import os
import re
import shutil
import stat
import sys
import uuid
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from trainer.errors import CheckpointError

CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})$")
TEMP_PREFIX = ".tmp-"
REPLACED_PREFIX = f"{TEMP_PREFIX}replaced-"
MANIFEST = "manifest.json"
# The first releases whose exclusive create ("xb") is a conditional write on the store (If-None-Match: *),
# read in their source: before, s3fs wrote over an existing object. Other backends are tried (see
# FsspecStorage._check_exclusive_create).
EXCLUSIVE_CREATE_SINCE = {"s3fs": "2024.12.0"}

FileWriter = Callable[[IO[bytes]], None]  # writes one file's content into an open binary handle
ManifestMaker = Callable[[dict[str, dict[str, Any]]], bytes]  # {filename: {"bytes", "crc32"}} -> manifest


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    match = CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


# Every 16 MB streamed to a local file, the kernel is asked to start writing it to the disk.
WRITEBACK_CHUNK = 16 << 20
# Pieces this large are checksummed in a second thread while the first writes them (both release the GIL).
PARALLEL_CHECKSUM_BYTES = 1 << 20
SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's sync_file_range (Python's os module lacks it), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return function  # type: ignore[no-any-return]


def file_descriptor(handle: IO[bytes]) -> int | None:
    """The OS file behind a handle, if there is one (fsspec's remote files have none)."""
    try:
        return handle.fileno()
    except (AttributeError, OSError, ValueError):
        return None


class ChecksumWriter:
    """Counts and checksums the bytes on their way to the file, so nothing is held in memory or read back.

    On a local file it also starts the disk writes as it goes (sync_file_range, every WRITEBACK_CHUNK):
    the final fsync then waits for the last chunk only, instead of the whole file written after the
    serialisation. Large pieces (a tensor's bytes) are checksummed in a thread of its own while this one
    copies them into the file. Use it as a context manager: the checksum thread ends with it.

    CRC-32 rather than SHA-256: the manifest guards against torn writes and corrupted media, not an
    attacker (who could rewrite the manifest too; weights_only loading is the defence there), and on
    CPUs without SHA extensions SHA-256 runs at ~0.15 GB/s, slower than the disk (bench/checkpoint_bench.py).
    """

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.bytes = 0
        self.crc32 = 0
        self.error: OSError | None = None
        self._descriptor = file_descriptor(handle)
        self._start_writeback = _sync_file_range() if self._descriptor is not None else None
        self._written_back = 0  # bytes whose disk writes have been started
        self._checksummer: ThreadPoolExecutor | None = None

    def __enter__(self) -> ChecksumWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._checksummer is not None:
            self._checksummer.shutdown()

    def write(self, data: bytes | memoryview) -> int:
        size = memoryview(data).nbytes
        pending: Future[int] | None = None
        if size >= PARALLEL_CHECKSUM_BYTES:
            if self._checksummer is None:
                self._checksummer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-checksum")
            pending = self._checksummer.submit(zlib.crc32, data, self.crc32)
        else:
            self.crc32 = zlib.crc32(data, self.crc32)
        self.bytes += size
        try:
            written = self._write(data)
        finally:
            if pending is not None:
                self.crc32 = pending.result()
        return written

    def _write(self, data: bytes | memoryview) -> int:
        try:
            written = self.handle.write(data)
            if self._start_writeback is not None and self.bytes - self._written_back >= WRITEBACK_CHUNK:
                self.handle.flush()
                # A hint: a failure here shows again, and is reported, at the fsync.
                self._start_writeback(self._descriptor, self._written_back, self.bytes - self._written_back,
                                      SYNC_FILE_RANGE_WRITE)
                self._written_back = self.bytes
            return written
        except OSError as error:
            self.error = error  # torch.save turns it into a RuntimeError about stream positions
            raise

    def flush(self) -> None:
        self.handle.flush()

    def summary(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "crc32": f"{self.crc32:08x}"}


def crc32_hex(data: bytes) -> str:
    return f"{zlib.crc32(data):08x}"


class NotAFile(ValueError):
    """A checkpoint's file that is a link, a FIFO or a device: never read (it could block, or lead elsewhere)."""


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


class CheckpointStorage(ABC):
    """The seam between the checkpoint logic and a file system."""

    def __init__(self, location: str) -> None:
        self.location = location

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
        return sorted(names, key=lambda name: step_of(name) or 0, reverse=True)

    def write(self, name: str, files: dict[str, FileWriter], make_manifest: ManifestMaker) -> None:
        """Stream the files, then the manifest describing them, then make the folder appear under ``name``."""
        temporary = f"{TEMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        try:
            self._make_folder(temporary)
            described: dict[str, dict[str, Any]] = {}
            for filename, write_content in files.items():
                with self._create(temporary, filename) as handle, ChecksumWriter(handle) as checksummed:
                    try:
                        write_content(checksummed)  # type: ignore[arg-type] - a write/flush file object
                    except Exception:
                        if checksummed.error is not None:
                            raise checksummed.error from None  # the cause a person can act on
                        raise
                described[filename] = checksummed.summary()
            with self._create(temporary, MANIFEST) as handle:
                handle.write(make_manifest(described))
            self._commit(temporary, name)
        except OSError as error:
            self._remove_quietly(temporary)
            raise CheckpointError(
                f"could not write checkpoint {self.describe(name)}: {self.reason(error)}. The previous "
                f"checkpoints are untouched; {_remedy(error, self.location)}"
            ) from None

    def remove_temporaries(self) -> list[str]:
        """Delete folders left by saves that crashed; they never held a usable checkpoint, except a
        checkpoint moved aside to be replaced when the crash came before its replacement was in place."""
        stale = [name for name in self._list() if name.startswith(TEMP_PREFIX)]
        present = set(self._list())
        for name in stale:
            original = _replaced_name(name)
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


class LocalStorage(CheckpointStorage):
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
            aside = f"{REPLACED_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
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


class FsspecStorage(CheckpointStorage):
    """Object stores have no atomic folder rename: the manifest, moved last and checked against the
    files' sizes and checksums, is what commits a checkpoint there."""

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

    def reason(self, error: OSError) -> str:
        text = super().reason(error)
        return text.replace(self.root, self.location.rstrip("/")) if self.root else text

    def _list(self) -> list[str]:
        if not self.fs.exists(self.root):
            return []
        entries = self.fs.ls(self.root, detail=True)
        return [entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries if entry["type"] == "directory"]

    def _make_folder(self, name: str) -> None:
        self.fs.makedirs(self._path(name), exist_ok=True)

    def _create(self, name: str, filename: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return self.fs.open(self._path(name, filename), "wb")  # an upload is complete once closed

    def _commit(self, temporary: str, name: str) -> None:
        if not self.fs.exists(self._path(name)):
            self._rename(temporary, name)
            return
        # A checkpoint of this step is there. It stays whole somewhere until the new one is in place: moved
        # aside with its manifest first (the folder under its name is at once no checkpoint), then the new
        # one moved in with its manifest last. A crash in between leaves remove_temporaries() what it needs
        # to put the old one back (_put_back).
        aside = f"{REPLACED_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        self._rename(name, aside, manifest_last=False)
        self._rename(temporary, name)
        self._remove_quietly(aside)

    def _rename(self, name: str, new_name: str, manifest_last: bool = True) -> None:
        # A move is a copy per object. Manifest last: a half-moved folder is no checkpoint at its new name.
        # Manifest first: none at its old name either.
        paths = sorted(self.fs.ls(self._path(name), detail=False),
                       key=lambda path: path.endswith(f"/{MANIFEST}") == manifest_last)
        self.fs.makedirs(self._path(new_name), exist_ok=True)  # file systems with folders do not make them in mv
        for path in paths:
            self.fs.mv(path, self._path(new_name, path.rsplit("/", 1)[-1]))
        if self.fs.exists(self._path(name)):  # stores without folders forget one with its last object
            self.fs.rm(self._path(name), recursive=True)

    def _put_back(self, aside: str, original: str) -> None:
        # What is left under the original name is the rest of the old checkpoint (the crash came while it
        # was moved aside) or part of the new one (while that was moved in, the old one whole aside): the
        # old files moved back over it, the manifest last, make the old checkpoint whole either way.
        self._rename(aside, original)

    def read(self, name: str, filename: str) -> bytes:
        return self.fs.cat_file(self._path(name, filename))  # type: ignore[no-any-return]

    def size(self, name: str, filename: str) -> int:
        info = self.fs.info(self._path(name, filename))
        if info.get("type") != "file" or info.get("islink"):
            raise NotAFile(f"{filename} is not a plain file; a checkpoint folder holds only the files the "
                           f"trainer wrote")
        return int(info["size"])

    def exists(self, name: str, filename: str) -> bool:
        return self.fs.isfile(self._path(name, filename))

    def has_folder(self, name: str) -> bool:
        return self.fs.isdir(self._path(name))

    def remove(self, name: str) -> None:
        # The manifest first: a half-removed folder is then never taken for a checkpoint.
        if self.fs.isfile(self._path(name, MANIFEST)):
            self.fs.rm(self._path(name, MANIFEST))
        self.fs.rm(self._path(name), recursive=True)

    def check_writable(self) -> None:
        probe = self._path(f"{TEMP_PREFIX}probe-{uuid.uuid4().hex[:8]}")
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm(probe)
        except Exception as error:  # noqa: BLE001 - fsspec backends raise their own exception types
            raise CheckpointError(
                f"checkpoint location {self.location} is not writable ({error}); check the URL and credentials"
            ) from None
        self._check_exclusive_create()

    def _check_exclusive_create(self) -> None:
        """The folder's lease needs a create that fails when the file exists, decided by the store itself
        (two racing jobs: exactly one wins). Backends whose "xb" mode is a plain write (older s3fs), or that do
        not have it, are refused with one line: checked by release where that is known, then by trying it."""
        package = type(self.fs).__module__.split(".", 1)[0]
        minimum = EXCLUSIVE_CREATE_SINCE.get(package)
        installed = metadata.version(package) if minimum is not None else ""
        if minimum is not None and _release(installed) < _release(minimum):
            raise CheckpointError(
                f"--checkpoint-dir {self.location}: {package} {installed} cannot create a file only "
                f"if it does not exist, which the checkpoint folder's lease needs (so that two jobs never share a "
                f"folder); install {package}>={minimum}")
        folder = f"{TEMP_PREFIX}exclusive-{uuid.uuid4().hex[:8]}"
        try:
            first, second = (self.create_exclusive(folder, "probe", b"1"), self.create_exclusive(folder, "probe", b"2"))
        except (NotImplementedError, ValueError, TypeError) as error:
            raise CheckpointError(
                f"--checkpoint-dir {self.location}: {type(self.fs).__name__} has no exclusive create "
                f"({error or type(error).__name__}), which the checkpoint folder's lease needs (so that two jobs "
                f"never share a folder); use a local or NFS folder, or s3:// with "
                f"s3fs>={EXCLUSIVE_CREATE_SINCE['s3fs']}") from None
        finally:
            with contextlib.suppress(Exception):
                self.fs.rm(self._path(folder), recursive=True)
        if not (first and not second):
            raise CheckpointError(
                f"--checkpoint-dir {self.location}: {type(self.fs).__name__} wrote over a file that its exclusive "
                f"create should have refused, so two jobs could both take the checkpoint folder's lease; use a local "
                f"or NFS folder, or s3:// with s3fs>={EXCLUSIVE_CREATE_SINCE['s3fs']} on a store with conditional "
                f"writes")

    def create_exclusive(self, name: str, filename: str, data: bytes) -> bool:
        # fsspec's exclusive mode: O_EXCL on local files, a conditional write (If-None-Match: *) in s3fs,
        # checked as the upload completes, so the content is whole when the file appears.
        self.fs.makedirs(self._path(name), exist_ok=True)
        try:
            with self.fs.open(self._path(name, filename), "xb") as handle:
                handle.write(data)
            return True
        except FileExistsError:
            return False

    def replace_file(self, name: str, filename: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(name, filename), data)  # one object write: old or new, never a part

    def files(self, name: str) -> list[str]:
        if not self.fs.isdir(self._path(name)):
            return []
        entries = self.fs.ls(self._path(name), detail=True)
        return [entry["name"].rsplit("/", 1)[-1] for entry in entries if entry["type"] == "file"]

    def remove_file(self, name: str, filename: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(name, filename))


def _release(version: str) -> tuple[int, ...]:
    """``2024.12.0`` as (2024, 12, 0): enough to compare the date-named releases of fsspec's backends."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def _replaced_name(name: str) -> str | None:
    """``step-N`` for a ``.tmp-replaced-step-N-<id>`` folder, else None."""
    if not name.startswith(REPLACED_PREFIX):
        return None
    original = name.removeprefix(REPLACED_PREFIX).rsplit("-", 1)[0]
    return original if step_of(original) is not None else None


def _remedy(error: OSError, location: str) -> str:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free space on {location}, lower --keep-last, or choose another --checkpoint-dir"
    return f"fix permissions on {location} or choose another --checkpoint-dir"


def fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def open_storage(location: str) -> CheckpointStorage:
    if "://" not in location or location.startswith("file://"):
        return LocalStorage(location)
    return FsspecStorage(location)
