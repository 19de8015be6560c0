"""One local copy per node of a checkpoint file that lives on an object store.

Every rank of a resume maps the whole-state file (trainer.checkpoint.state_file); from an object store it is first
downloaded to a local file. Eight ranks of one node would download it eight times: instead the first process of the
node to ask downloads it (through its checksum) into this user's own folder under TMPDIR, under a lock, and renames
it into place once whole and checked; the others wait for the lock and map the same file. It is removed once every
rank has mapped it (``release``), and a copy a crash left behind is reused by the next resume of that checkpoint or
removed by any download a day later.

The folder is ``$TMPDIR/ddp-deploy-<uid>``, mode 0700 and owned by this user, so that no other user of a shared
/tmp can plant or replace a file there; where it cannot be made so, ``fetch`` returns None and each process keeps a
copy of its own, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import stat
import tempfile
import time
from collections.abc import Callable
from typing import IO

PREFIX = "ddp-deploy-state-"
# A copy or an unfinished download older than this is left from a crash: no resume maps a file for so long.
STALE_AFTER_S = 24 * 3600


def copy_key(*identity: str) -> str:
    """A file name for one checkpoint file (its location, folder, name, size and checksum): the URL's credentials,
    if any, are hashed, never written out."""
    return hashlib.sha256("\0".join(identity).encode()).hexdigest()[:24]


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


def fetch(key: str, size: int, download: Callable[[IO[bytes]], None]) -> tuple[str, bool] | None:
    """The node's copy of the file named by ``key``: its path, and whether this process downloaded it (``download``
    writes the checked bytes into a file it is given; what it raises is raised here, no copy left). None where there
    is no private folder: the caller makes a copy of its own."""
    folder = private_folder()
    if folder is None:
        return None
    path = os.path.join(folder, f"{PREFIX}{key}.pt")
    lock = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other processes wait here while one downloads
        if _whole(path, size):
            return path, False
        _remove_stale(folder)
        partial = f"{path}.partial-{os.getpid()}"
        try:
            with open(partial, "wb", opener=lambda name, flags: os.open(
                    name, flags | os.O_EXCL | os.O_NOFOLLOW, 0o600)) as handle:
                download(handle)
            os.replace(partial, path)  # in place only once whole and checked: a present copy is a good one
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
        return path, True
    finally:
        os.close(lock)


def release(path: str) -> None:
    """Remove the node's copy once every rank has mapped it (a mapping keeps its pages readable)."""
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
