"""One driver per run: a second driver of the same run would be the same job to the checkpoint folder's lease (that
is how a driver started again after a crash resumes at once), and the two would take the checkpoints from each
other. A POSIX lock on RUN/.driver.lock, which the system releases when the driver dies, however it dies.

The lock holds between machines only where the run's folder is on a filesystem that passes POSIX locks to a server:
local disk (one machine), NFS with its lock manager (v3 ``lock``, the default, or v4). An NFS mount with ``nolock``
or ``local_lock=posix``/``all`` locks on the client alone: two drivers on two machines both get it. That is read from
the mount's options (/proc/self/mountinfo) and said in a warning, since lockf itself succeeds there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainer.on_ray.settings import RayLaunchError

__all__ = ["DRIVER_LOCK", "Mount", "driving", "locks_only_locally", "mount_of"]

DRIVER_LOCK = ".driver.lock"
MOUNTINFO = Path("/proc/self/mountinfo")
NFS = ("nfs", "nfs4")


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    options: frozenset[str]  # the mount's and the superblock's options together


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...); the rest is the path's own bytes.
    raw = os.fsencode(field)
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda octal: bytes([int(octal.group(1), 8)]), raw))


def mount_of(path: Path, mountinfo: Path = MOUNTINFO) -> Mount | None:
    """The mount ``path`` is on (the longest mount point above it), from ``mountinfo``; None where unreadable."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: Mount | None = None
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 6 or len(tail) < 3:
            continue
        point = _unescape(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            best = Mount(point, tail[0], frozenset(fields[5].split(",")) | frozenset(tail[2].split(",")))
    return best


def locks_only_locally(mount: Mount | None) -> bool:
    """Whether POSIX locks on this mount are the client's alone (another machine's driver would get the lock)."""
    if mount is None or mount.fstype not in NFS:
        return False
    return "nolock" in mount.options or bool({"local_lock=posix", "local_lock=all"} & mount.options)


@contextlib.contextmanager
def driving(folder: Path, mountinfo: Path = MOUNTINFO) -> Iterator[None]:
    """This driver's hold on its run, for as long as it runs (the module's docstring says where it holds)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = (folder / DRIVER_LOCK).open("a+")
    except OSError as error:
        raise RayLaunchError(f"cannot write the Ray run's folder {folder} ({error.strerror or error}); choose another "
                             f"--ray-storage-path") from None
    with handle:
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EACCES):  # locking itself fails here (ENOLCK, ...)
                _warn(f"cannot lock {folder / DRIVER_LOCK} ({error.strerror})")
                yield
                return
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise RayLaunchError(f"run {folder} already has a driver ({holder}): two drivers of one run would take "
                                 f"its checkpoints from each other; stop that one, or choose another --ray-run-name"
                                 ) from None
        mount = mount_of(folder, mountinfo)
        if locks_only_locally(mount):
            assert mount is not None
            option = "nolock" if "nolock" in mount.options else next(o for o in mount.options
                                                                   if o.startswith("local_lock="))
            _warn(f"{folder} is on an NFS mount with {option} ({mount.point}), where locks are this machine's "
                  f"alone")
        handle.seek(0)
        handle.truncate()
        handle.write(f"ddp-train-ray pid {os.getpid()} on {socket.gethostname()}")
        handle.flush()
        yield


def _warn(why: str) -> None:
    print(f"warning: {why}: a second driver of this run on another machine would not be refused", file=sys.stderr,
          flush=True)
