"""Checkpoints at any fsspec URL (s3://, az://, memory://): the manifest, written last into a save's own folder,
commits one."""

from __future__ import annotations

import contextlib
import re
import uuid
from importlib import metadata
from typing import IO

from trainer.checkpoint.save_failures import is_transient
from trainer.checkpoint.storage.base import MANIFEST, CheckpointStorage, NotAFile
from trainer.checkpoint.storage.names import TEMP_PREFIX
from trainer.errors import CheckpointError, StorageUnavailable
from trainer.object_store_client import bounded_options, without_own_retries
from trainer.redact import redact

# The first releases whose exclusive create ("xb") is a conditional write on the store (If-None-Match: *),
# read in their source: before, s3fs wrote over an existing object, and adlfs (az://, abfs://) had no "xb" (its
# block list's commit carries the header since 2024.12.0). Other backends are tried (see
# FsspecStorage._check_exclusive_create).
EXCLUSIVE_CREATE_SINCE = {"s3fs": "2024.12.0", "adlfs": "2024.12.0"}
# What a refusal offers instead: every backend above, at its release.
WITH_EXCLUSIVE_CREATE = "an object store through " + " or ".join(
    f"{package}>={release}" for package, release in EXCLUSIVE_CREATE_SINCE.items())
# A request to the store: attempts (botocore's backoff between them) and its connect/read timeout. A part of a
# checkpoint's upload is answered well within the timeout at any usable bandwidth.
CLIENT_ATTEMPTS = 3
CLIENT_REQUEST_TIMEOUT_S = 60.0


class FsspecStorage(CheckpointStorage):
    """Object stores have no atomic folder rename: each save writes a folder of its own (``step-N.<save>``), and
    its manifest, written last and checked against the files' sizes and checksums, is what commits it there. Nothing
    is moved: a move on S3 is a server-side copy of every object."""

    commits_in_place = True

    @classmethod
    def handles(cls, location: str) -> bool:
        return "://" in location

    def __init__(self, location: str) -> None:
        super().__init__(location)
        try:
            import fsspec

            # No cached listings: a job must see the lease files and checkpoints as they are now, never as its own
            # client last listed them (a job woken from a pause would pass its lease check on a stale listing).
            # A few attempts per request, not s3fs's and botocore's minute of them: a save that fails is tried
            # again at the next save point (trainer.checkpoint.save_failures), and training waits for none.
            protocol = location.split("://", 1)[0]
            self.fs, self.root = fsspec.core.url_to_fs(
                location, use_listings_cache=False,
                **bounded_options(protocol, CLIENT_ATTEMPTS, CLIENT_REQUEST_TIMEOUT_S))
            without_own_retries(self.fs, CLIENT_ATTEMPTS, CLIENT_REQUEST_TIMEOUT_S)
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
        return redact(text.replace(self.root, self.location.rstrip("/")) if self.root else text, self.location)

    def _list(self) -> list[str]:
        try:  # not exists() first: it answers False for any error, and a resume would then start afresh
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return [entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries if entry["type"] == "directory"]

    def _make_folder(self, name: str) -> None:
        self.fs.makedirs(self._path(name), exist_ok=True)

    def _create(self, name: str, filename: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return self.fs.open(self._path(name, filename), "wb")  # an upload is complete once closed

    def _commit(self, temporary: str, name: str) -> None:
        # Never reached while commits_in_place: the manifest, written last into the save's own folder, commits
        # it. A subclass that turns that off (figure 14 measures the previous release's move) moves the folder,
        # manifest last, to a name no checkpoint has: a move is a copy per object, never atomic.
        if self.fs.exists(self._path(name)):
            raise FileExistsError(17, "a checkpoint of this step is there already", name)
        self._rename(temporary, name)

    def _rename(self, name: str, new_name: str) -> None:
        # A move is a copy per object. Manifest last: a half-moved folder is no checkpoint at its new name.
        paths = sorted(self.fs.ls(self._path(name), detail=False), key=lambda path: path.endswith(f"/{MANIFEST}"))
        self.fs.makedirs(self._path(new_name), exist_ok=True)  # file systems with folders do not make them in mv
        for path in paths:
            self.fs.mv(path, self._path(new_name, path.rsplit("/", 1)[-1]))
        if self.fs.exists(self._path(name)):  # stores without folders forget one with its last object
            self.fs.rm(self._path(name), recursive=True)

    def _put_back(self, aside: str, original: str) -> None:
        # A leftover of releases that moved a save into place (replacing a step's checkpoint moved it aside first).
        # What is left under the original name is the rest of the old checkpoint (the crash came while it
        # was moved aside) or part of the new one (while that was moved in, the old one whole aside): the
        # old files moved back over it, the manifest last, make the old checkpoint whole either way.
        self._rename(aside, original)

    def read(self, name: str, filename: str) -> bytes:
        return self.fs.cat_file(self._path(name, filename))  # type: ignore[no-any-return]

    def read_range(self, name: str, filename: str, offset: int, length: int) -> bytes:
        # One ranged request (an S3 GET with a Range header): only the bytes asked for cross the network.
        return self.fs.cat_file(self._path(name, filename), start=offset, end=offset + length)  # type: ignore[no-any-return]

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

    def _remove_quietly(self, name: str) -> None:
        # A failed save's folder, removed on the way out of that failure: whatever the store says then must not
        # take the place of the save's own error. adlfs raises azure-core's errors, not OSErrors; the next start
        # removes what is left (remove_temporaries).
        with contextlib.suppress(Exception):  # noqa: BLE001 - fsspec backends raise their own exception types
            self.remove(name)

    def check_writable(self) -> None:
        probe = self._path(f"{TEMP_PREFIX}probe-{uuid.uuid4().hex[:8]}")
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm(probe)
        except Exception as error:  # noqa: BLE001 - fsspec backends raise their own exception types
            if is_transient(error):  # throttled, a 5xx, unreachable: the restarted job may find it answering
                raise StorageUnavailable(redact(f"checkpoint location {self.location} did not answer ({error})",
                                                self.location)) from None
            raise CheckpointError(redact(  # the client's own words may quote the URL's secrets without a scheme
                f"checkpoint location {self.location} is not writable ({error}); check the URL and credentials",
                self.location)) from None
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
                f"never share a folder); use a local or NFS folder, or {WITH_EXCLUSIVE_CREATE}") from None
        finally:
            with contextlib.suppress(Exception):
                self.fs.rm(self._path(folder), recursive=True)
        if not (first and not second):
            raise CheckpointError(
                f"--checkpoint-dir {self.location}: {type(self.fs).__name__} wrote over a file that its exclusive "
                f"create should have refused, so two jobs could both take the checkpoint folder's lease; use a local "
                f"or NFS folder, or {WITH_EXCLUSIVE_CREATE} on a store with conditional writes")

    def create_exclusive(self, name: str, filename: str, data: bytes) -> bool:
        # fsspec's exclusive mode: O_EXCL on local files, a conditional write (If-None-Match: *) in s3fs and in
        # adlfs (on the commit of the block list), checked as the upload completes, so the content is whole when
        # the file appears.
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
        # ls, not isdir first: fsspec's isdir answers False for any error, and a store that did not answer is no
        # empty folder (a lease that looks free, a checkpoint whose files look gone).
        try:
            entries = self.fs.ls(self._path(name), detail=True)
        except FileNotFoundError:
            return []
        return [entry["name"].rsplit("/", 1)[-1] for entry in entries if entry["type"] == "file"]

    def remove_file(self, name: str, filename: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(name, filename))


def _release(version: str) -> tuple[int, ...]:
    """``2024.12.0`` as (2024, 12, 0): enough to compare the date-named releases of fsspec's backends."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])

