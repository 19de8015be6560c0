"""A rank's node-local cache of pieces: the byte ranges of shards it trains this epoch, each a file of its own.

A piece (trainer.data.shards.order.Piece) is fetched with one range request, checked sample by sample against the
CRC-32s of its shard's index, written under a temporary name and renamed into place, so a reader never sees half
of one. The rank's main process (the prefetcher) and its DataLoader workers share the folder: whoever needs a piece
first fetches it under the piece's lock, and the other finds it there. Only the prefetcher deletes pieces, once
every sample of theirs that this rank reads has been read.

Each rank has a folder of its own, held by a lock for the life of its process, so that two jobs on one node (or
a job and the leftovers of a killed one) never share or wipe each other's pieces. Every fetch is one line in
``fetched.log``: the figures count the bytes a node took from the store with it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from trainer.data.shards.layout import SampleSpan, ShardEntry, ShardIndex
from trainer.data.shards.order import Piece
from trainer.data.shards.store import ShardStore
from trainer.errors import DataError, DataUnavailable

__all__ = ["MAX_FETCH_THREADS", "PieceCache", "claim_folder"]

log = logging.getLogger(__name__)
FETCH_LOG = "fetched.log"
OWNER_LOCK = ".owner.lock"
_SIDECARS_KEPT = 32


# Pieces fetched at once, by a rank's prefetcher or by a batch's read: an object store answers each request after a
# round trip (tens of ms), so requests side by side fill the link, and the first windows of an epoch (one per lane
# the rank reads) arrive together rather than one round trip after another. Each request also costs CPU (signing,
# checksums: a few ms in Python), so each process (a rank's prefetcher, and each of its DataLoader workers for the
# pieces of its batch) fetches with no more threads than the rank's share of the cores (trainer.data.shards.fetching):
# on a 2-core machine with 2 ranks and the store beside them, one thread each reached the first step sooner than four
# (6.6-7.3 s against 7.9-8.4 s).
MAX_FETCH_THREADS = 4


def claim_folder(parent: Path, name: str) -> tuple[Path, IO[bytes]]:
    """A folder ``parent/name`` (or ``name-2``, ``name-3``...) that no live process holds, emptied, and the open
    lock file that holds it for this process (keep it open: closing it lets another process take the folder)."""
    for attempt in range(1, 1000):
        folder = parent / (name if attempt == 1 else f"{name}-{attempt}")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock = open(folder / OWNER_LOCK, "ab")  # noqa: SIM115 - held for the life of the process
        except OSError as error:
            raise DataError(f"the shard cache {parent}: cannot create {folder} ({error.strerror or error}); set "
                            f"--shard-cache-dir to a writable folder") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        for entry in folder.iterdir():  # a killed run's pieces: never trusted, never counted against the bound
            if entry.name != OWNER_LOCK:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink(missing_ok=True)
        return folder, lock
    raise DataError(f"the shard cache {parent}: 999 folders named {name}* are held by live processes")


@dataclass
class PieceCache:
    folder: Path
    store: ShardStore
    shards: list[ShardEntry]
    fetch_threads: int = MAX_FETCH_THREADS  # requests in flight at once, per process

    def __post_init__(self) -> None:
        self._indexes: OrderedDict[int, ShardIndex] = OrderedDict()
        self._indexes_lock = threading.Lock()  # the prefetch thread and the main thread both read them

    def __getstate__(self) -> dict[str, object]:
        return {"folder": self.folder, "store": self.store, "shards": self.shards,
                "fetch_threads": self.fetch_threads}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def path(self, piece: Piece) -> Path:
        return self.folder / f"{piece.shard:06d}.{piece.first}-{piece.end}.piece"

    def shard_index(self, shard: int) -> ShardIndex:
        """The shard's own index: from this process's memory, the cache folder, or the store (checked)."""
        with self._indexes_lock:
            cached = self._indexes.get(shard)
            if cached is not None:
                self._indexes.move_to_end(shard)
                return cached
        entry = self.shards[shard]
        local = self.folder / f"{shard:06d}.idx.json"
        try:
            data: bytes | None = local.read_bytes()
        except FileNotFoundError:  # never fetched here, or deleted with its last piece a moment ago
            data = None
        if data is None or zlib.crc32(data) != entry.sidecar_crc32:
            data = self._fetch_checked_sidecar(entry)
            self._write(local, data, f"the index of shard {entry.name}")
            self._record(f"pid{os.getpid()} {shard} -1 -1 {len(data)}")
        index = ShardIndex.from_json(data, self.store.where(entry.sidecar))
        if len(index.samples) < entry.samples or index.bytes != entry.bytes:
            raise DataError(f"{self.store.where(entry.sidecar)}: {len(index.samples)} samples and {index.bytes} bytes, "
                            f"but index.json lists {entry.samples} and {entry.bytes}; rebuild the index (ddp-shard "
                            f"index)")
        with self._indexes_lock:
            self._indexes[shard] = index
            if len(self._indexes) > _SIDECARS_KEPT:
                self._indexes.popitem(last=False)
        return index

    def _fetch_checked_sidecar(self, entry: ShardEntry) -> bytes:
        for _ in range(2):  # a second fetch where a transfer was damaged on the way
            data = self.store.read(entry.sidecar)
            if zlib.crc32(data) == entry.sidecar_crc32:
                return data
        raise DataError(f"{self.store.where(entry.sidecar)}: its CRC-32 is not the one index.json lists for it; the "
                        f"index and the shards are from different writes: rebuild the index (ddp-shard index)")

    def piece_bytes(self, piece: Piece) -> int:
        spans = self.shard_index(piece.shard).samples
        return spans[piece.end - 1].end - spans[piece.first].start

    def ensure(self, piece: Piece, who: str) -> Path:
        """The piece's file, fetched first if it is not in the cache (under its lock: one fetch per piece)."""
        path = self.path(piece)
        if path.exists():
            return path
        lock_path = path.with_suffix(".lock")
        with open(lock_path, "ab") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not path.exists():
                    self._raise_recorded_failure(path)
                    try:
                        data = self._download(piece)
                    except DataError as error:
                        self._record_failure(path, error)
                        raise
                    self._write(path, data, f"shard {self.shards[piece.shard].name}")
                    self._record(f"{who} {piece.shard} {piece.first} {piece.end} {len(data)}")
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return path

    # A fetch that failed (its retries spent, or the data bad) is recorded beside the piece, so that the next process
    # that needs the piece (the prefetcher's failure, then a worker) raises it at once instead of spending the
    # retries again: a store that is gone ends the run after one round of retries, not one per process. A store's
    # failure is taken as final for one round of retries only (it may be back by then); bad data for good.
    def _record_failure(self, path: Path, error: DataError) -> None:
        with contextlib.suppress(OSError):  # unrecorded, the next process retries: slower, never wrong
            path.with_suffix(".failed").write_text(f"{type(error).__name__}\n{error}")

    def _raise_recorded_failure(self, path: Path) -> None:
        marker = path.with_suffix(".failed")
        try:
            kind, _, message = marker.read_text().partition("\n")
            age_s = time.time() - marker.stat().st_mtime
        except (FileNotFoundError, UnicodeDecodeError):
            return
        if kind == DataUnavailable.__name__:
            if age_s > sum(self.store.retry.delays()) + self.store.retry.request_timeout_s:
                marker.unlink(missing_ok=True)
                return
            raise DataUnavailable(message)
        raise DataError(message)

    def _download(self, piece: Piece) -> bytes:
        """The piece's bytes from the store, each sample checked against its CRC-32."""
        entry = self.shards[piece.shard]
        spans = self.shard_index(piece.shard).samples[piece.first:piece.end]
        start, end = spans[0].start, spans[-1].end
        for attempt in range(2):  # a second fetch where a transfer was damaged on the way
            data = self.store.read(entry.name, start, end)
            bad = _first_damaged(data, start, spans)
            if bad is None:
                return data
            if attempt == 1:
                raise DataError(f"{self.store.where(entry.name)}: sample {bad.key} (bytes {bad.start}..{bad.end}) does "
                                f"not match its CRC-32 in the shard's index, fetched twice: the shard is corrupt; "
                                f"write it again (ddp-shard) or restore it")
            log.warning("%s: sample %s arrived damaged; fetching its piece again", self.store.where(entry.name),
                        bad.key)
        raise AssertionError("unreachable")

    def _record(self, line: str) -> None:
        """A fetch in fetched.log: WHO SHARD FIRST END BYTES (FIRST = END = -1: the shard's own index)."""
        try:
            with open(self.folder / FETCH_LOG, "a") as record:  # one write per line: appends never interleave
                record.write(line + "\n")
        except OSError:
            pass  # the record is for the figures; the piece is in place

    def _write(self, path: Path, data: bytes, what: str) -> None:
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        try:
            with open(temporary, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(self.folder).free
                raise DataError(f"the shard cache {self.folder} is full ({free / 1e6:.0f} MB free) writing "
                                f"{len(data) / 1e6:.1f} MB of {what}; free space there, lower --shard-cache-gb below "
                                f"the disk's free space, or set --shard-cache-dir to a larger disk") from None
            raise DataError(f"the shard cache {self.folder}: cannot write {path.name} ({error.strerror or error}); "
                            f"set --shard-cache-dir to a writable folder") from None

    def evict_all(self) -> None:
        """Everything in the folder but its log and lock: what a plan never held too (a piece a worker fetched for a
        window the prefetcher had passed, their locks, shard indexes, recorded failures)."""
        for path in self.folder.iterdir():
            # Not the log, nor any dot-file: the folder's lock, and the temporary files of writes in flight (a
            # worker's rename would fail on a deleted one).
            if path.name != FETCH_LOG and not path.name.startswith("."):
                path.unlink(missing_ok=True)

    def evict_index(self, shard: int) -> None:
        """The shard's index file, once no piece of it is held (a later piece fetches it again)."""
        (self.folder / f"{shard:06d}.idx.json").unlink(missing_ok=True)

    def evict(self, piece: Piece) -> None:
        path = self.path(piece)
        for suffix in (".piece", ".lock", ".failed"):
            path.with_suffix(suffix).unlink(missing_ok=True)

    def read_sample(self, piece: Piece, index_in_shard: int, who: str) -> tuple[str, dict[str, bytes]]:
        """(key, extension -> bytes) of a sample of the piece."""
        spans = self.shard_index(piece.shard).samples
        base = spans[piece.first].start
        sample = spans[index_in_shard]
        path = self.ensure(piece, who)
        try:
            file = open(path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:  # deleted in between (a placeholder read after its window was evicted)
            file = open(self.ensure(piece, who), "rb")  # noqa: SIM115
        with file:
            members = {}
            for extension, offset, size in sample.members:
                file.seek(offset - base)
                members[extension] = file.read(size)
        return sample.key, members


def _first_damaged(data: bytes, base: int, spans: list[SampleSpan]) -> SampleSpan | None:
    for span in spans:
        if zlib.crc32(data[span.start - base:span.end - base]) != span.crc32:
            return span
    return None
