"""One local copy per node of a checkpoint file that lives on an object store, for the ranks of one resume.

Every rank of a resume maps the whole-state file (trainer.checkpoint.state_file); from an object store it is first
downloaded to a local file. Eight ranks of one node would download it eight times: instead the first rank of the
node to ask downloads it (through its checksum) under a lock, and renames it into place once whole and checked; the
others wait for the lock and map the same file. Once every rank of the resume has mapped it (they agree on that),
each removes it (``release``): a mapping keeps its pages readable.

The copy is named after the resume (a token rank 0 draws and sends every rank) and the host: no other resume,
job or node ever opens it, so its removal can never pull it from under anyone, and a copy is never taken from an
earlier resume (nor checked again). A rank killed while downloading leaves a partial file that the next rank of its
resume removes under the lock; a resume that crashed leaves files that any download removes a day later.

The folder is ``$TMPDIR/ddp-deploy-<uid>``, mode 0700 and owned by this user, so that no other user of a shared
/tmp can plant or replace a file there; where it cannot be made so, ``fetch`` returns None and each process keeps a
copy of its own, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from typing import IO

PREFIX = "ddp-deploy-state-"
# Left by a resume that crashed: no resume maps a file for so long.
STALE_AFTER_S = 24 * 3600


def copy_key(*identity: str) -> str:
    """A file name for one resume's copy of one checkpoint file on this host (from the file's location, folder,
    name, size and checksum, and the resume's token): the URL's credentials, if any, are hashed, never written."""
    return hashlib.sha256("\0".join((*identity, socket.gethostname())).encode()).hexdigest()[:24]


def private_folder() -> str | None:
    """This user's folder under TMPDIR (made if absent), or None where it is not this user's alone."""
    folder = os.path.join(tempfile.gettempdir(), f"ddp-deploy-{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        found = os.lstat(folder)
    except OSError:
        return None
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        return None
    return folder


def copy_path(key: str) -> str | None:
    """Where the node's copy of the file named by ``key`` goes, or None where there is no private folder (the
    caller then makes a copy of its own)."""
    folder = private_folder()
    return None if folder is None else os.path.join(folder, f"{PREFIX}{key}.pt")


def fetch(path: str, size: int, download: Callable[[IO[bytes]], None]) -> None:
    """Make the node's copy at ``path`` (``copy_path``), downloaded by the first process to ask (``download``
    writes the checked bytes into a file it is given; what it raises is raised here, nothing left but the lock,
    which ``release`` removes)."""
    folder = os.path.dirname(path)
    lock = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the resume's other ranks on this node wait here while one downloads
        if _whole(path, size):
            return
        _remove_stale(folder)
        for dead in glob.glob(f"{glob.escape(path)}.partial-*"):  # a rank of this resume killed mid-download
            with contextlib.suppress(OSError):
                os.unlink(dead)
        descriptor, partial = tempfile.mkstemp(prefix=f"{os.path.basename(path)}.partial-", dir=folder)
        try:
            with os.fdopen(descriptor, "wb") as handle:
                download(handle)
            os.replace(partial, path)  # in place only once whole and checked
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
    finally:
        os.close(lock)


def release(path: str) -> None:
    """Remove the node's copy and its lock once every rank of the resume has mapped it."""
    for leftover in (path, f"{path}.lock"):
        with contextlib.suppress(OSError):
            os.unlink(leftover)


def _whole(path: str, size: int) -> bool:
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(found.st_mode) and found.st_size == size


def _remove_stale(folder: str) -> None:
    now = time.time()
    for entry in os.scandir(folder):
        with contextlib.suppress(OSError):
            if entry.name.startswith(PREFIX) and now - entry.stat(follow_symlinks=False).st_mtime > STALE_AFTER_S:
                os.unlink(entry.path)
