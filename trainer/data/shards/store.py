"""Reading a sharded dataset's files from where it lives (any fsspec URL or a local folder), with bounded retries.

What a failure means decides what happens: a file that is not there (404), or that the credentials may not read
(403), is the data's fault and ends the run with exit 2 naming the file; anything else (throttling, a 5xx, a dropped
connection, a timeout) is retried with exponential backoff, a bounded number of times, then ends the run with exit
200 so that the launcher restarts it from its last checkpoint. No request waits for ever: S3's client is given
connect and read timeouts.
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
import time
from dataclasses import dataclass
from typing import Any

from trainer.errors import DataError, DataUnavailable, described
from trainer.object_store_client import bounded_options, without_own_retries
from trainer.redact import redact

__all__ = ["RetryPolicy", "ShardStore"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6  # per request, the first included
    first_backoff_s: float = 0.5  # doubled after each failure
    max_backoff_s: float = 8.0
    # S3's connect and read timeouts (botocore's are 60 s each): a store that stops answering mid-body would hold a
    # read for that long per attempt; a range of a shard arrives in far less at any usable bandwidth.
    request_timeout_s: float = 30.0

    def delays(self) -> list[float]:
        return [min(self.max_backoff_s, self.first_backoff_s * 2 ** attempt) for attempt in range(self.attempts - 1)]


class ShardStore:
    """The dataset's prefix: reads whole files and byte ranges. Picklable: each process (DataLoader workers
    included) opens its own client on first use, never one inherited across a fork."""

    def __init__(self, url: str, retry: RetryPolicy | None = None) -> None:
        self.url = url.rstrip("/") if "://" in url else os.path.abspath(os.path.expanduser(url))
        self.shown = redact(self.url)
        self.retry = retry or RetryPolicy()
        self._fs: Any = None
        self._root = ""
        self._pid = -1
        self._opening = threading.Lock()  # one client per process, though several threads ask for it at once

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_pid": -1, "_opening": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._opening = threading.Lock()

    def _filesystem(self) -> tuple[Any, str]:
        if self._fs is not None and self._pid == os.getpid():
            return self._fs, self._root
        with self._opening:
            return self._open_filesystem()

    def _open_filesystem(self) -> tuple[Any, str]:
        if self._fs is None or self._pid != os.getpid():
            self._fs = None  # an inherited client (a fork) is never used here: the check above sees no client
            import fsspec

            protocol = self.url.split("://", 1)[0] if "://" in self.url else "file"
            # One attempt per request: ours are the retries (RetryPolicy), with their own backoff.
            options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False,
                                       **bounded_options(protocol, 1, self.retry.request_timeout_s)}
            try:
                fs, root = fsspec.core.url_to_fs(self.url, **options)
            except (ImportError, ValueError) as error:
                raise DataError(f"--data-dir {self.shown}: no filesystem for this URL ({error}); install its fsspec "
                                f"package (s3fs for s3://, gcsfs for gs://) or use a local folder") from None
            without_own_retries(fs, 1, self.retry.request_timeout_s)
            # The client last, ready: another thread's check without the lock sees it whole or not at all.
            self._root, self._pid = root.rstrip("/"), os.getpid()
            self._fs = fs
        return self._fs, self._root

    def where(self, name: str) -> str:
        return f"{self.shown}/{name}"

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """A file's bytes, or bytes start..end-1 of it (a range request); exactly that many, or DataError."""
        def once() -> bytes:
            fs, root = self._filesystem()
            return fs.cat_file(posixpath.join(root, name), start=start, end=end)  # type: ignore[no-any-return]

        data = self._retried(once, name)
        if start is not None and end is not None and len(data) != end - start:
            raise DataError(f"{self.where(name)}: truncated: {len(data)} of the {end - start} bytes at offset {start} "
                            f"that its index lists; upload the shard again or rebuild the index (ddp-shard index)")
        return data

    def open(self, name: str) -> Any:
        """A file opened for reading front to back (indexing a shard)."""
        fs, root = self._filesystem()
        return self._retried(lambda: fs.open(posixpath.join(root, name), "rb", block_size=8 << 20), name)

    def sizes(self) -> dict[str, int]:
        """Every file directly under the prefix, by name, with its size: one listing."""
        def once() -> dict[str, int]:
            fs, root = self._filesystem()
            entries = fs.ls(root, detail=True)
            return {posixpath.basename(entry["name"].rstrip("/")): int(entry.get("size") or 0)
                    for entry in entries if entry.get("type") == "file"}

        return self._retried(once, "")

    def _retried(self, call: Any, name: str) -> Any:
        shown = self.where(name) if name else self.shown
        delays = self.retry.delays()
        started = time.monotonic()
        for attempt in range(self.retry.attempts):
            try:
                return call()
            except FileNotFoundError:
                raise DataError(f"{shown}: not found (the store answered 404); upload it, or point --data-dir at the "
                                f"prefix that holds the dataset's index.json and shards") from None
            except PermissionError as error:
                raise DataError(f"{shown}: access denied ({described(error)}); give this job credentials that may read "
                                f"it (for S3: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or a role)"
                                ) from None
            except (IsADirectoryError, NotADirectoryError) as error:
                raise DataError(f"{shown}: {described(error)}; --data-dir must name the dataset's prefix") from None
            except DataError:
                raise
            except Exception as error:  # noqa: BLE001 - every store has its own transient errors (botocore, aiohttp)
                reason = redact(described(error), self.url)
                if attempt + 1 >= self.retry.attempts:
                    raise DataUnavailable(
                        f"{shown}: the store kept failing ({reason}) through {self.retry.attempts} attempts over "
                        f"{time.monotonic() - started:.0f} s; nothing is wrong with the data: the job ends to be "
                        f"restarted from its last checkpoint") from None
                log.warning("%s: %s; retrying in %.1f s (attempt %d of %d)", shown, reason, delays[attempt],
                            attempt + 2, self.retry.attempts)
                time.sleep(delays[attempt])
        raise AssertionError("unreachable")
