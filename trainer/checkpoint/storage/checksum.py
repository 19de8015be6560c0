"""Streaming a file through a CRC-32 and, on local disks, the kernel's write-back as it goes."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

try:  # zlib-ng's CRC-32: the same checksum as zlib's, five times faster here (SIMD folding); zlib's where zlib-ng
    # is not installed (the repository run from PYTHONPATH): checkpoints are the same either way.
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - a dependency of the package
    from zlib import crc32

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
            pending = self._checksummer.submit(crc32, data, self.crc32)
        else:
            self.crc32 = crc32(data, self.crc32)
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
    return f"{crc32(data):08x}"

