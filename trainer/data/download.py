"""--download: torchvision's dataset classes fetch the files; they know the mirrors and checksums."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainer.data.catalog import DatasetSpec
from trainer.data.locate import holds_dataset, local_filesystem
from trainer.errors import DataError

log = logging.getLogger(__name__)
# torchvision opens URLs without a timeout: a connection that a firewall silently drops would stall
# this rank for ever while the other ranks wait for it. Per connect and per read, not for the whole file.
SOCKET_TIMEOUT_S = 60.0
# Downloads in progress and their lock: hidden names, never taken for a dataset's files.
STAGING_PREFIX = ".download-"
# What flock says on a file system that has no locks at all.
NO_LOCKS = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK)


def download(spec: DatasetSpec, data_dir: Path) -> None:
    """Download spec's dataset into data_dir in torchvision's layout (e.g. data_dir/FashionMNIST/raw).

    data_dir may be shared by several nodes (Compose mounts one data volume into every node, a cluster a
    network folder), each of which downloads: one of them at a time, under a lock on the folder, into a
    staging folder of its own, its files then renamed into place, so no reader ever sees half a file; the
    others find the dataset complete once they hold the lock, and download nothing.
    """
    # Imported here: torchvision costs a second at start-up, and only --download needs it.
    import torchvision.datasets

    dataset_class = getattr(torchvision.datasets, spec.torchvision_class)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        with _one_writer(data_dir / f"{STAGING_PREFIX}{spec.name}.lock"):
            if holds_dataset(local_filesystem(), str(data_dir), spec):
                log.info("%s is in %s already (downloaded by another node)", spec.name, data_dir)
                return
            log.info("downloading %s into %s", spec.name, data_dir)
            staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{spec.name}-", dir=data_dir))
            try:
                with _socket_timeout(SOCKET_TIMEOUT_S):
                    # Downloads every split (torchvision fetches all files whatever `train` says); the test
                    # split is the smaller one to load as a check.
                    dataset_class(str(staging), train=False, download=True)
                _move_into_place(staging, data_dir)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except (RuntimeError, OSError) as error:
        reason = " ".join(str(error).split())  # torchvision's message spans lines, one per mirror tried
        raise DataError(
            f"--download: could not download {spec.name} into {data_dir}: {reason}. Without internet access, "
            f"copy {spec.describe_files()} into {data_dir} and run without --download"
        ) from None


@contextmanager
def _one_writer(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file, waiting for another process's: flock works between processes and
    containers on one host and over NFS (as a POSIX lock), and the kernel drops it when its holder dies, so
    a killed download blocks nobody.

    A file system without locks (Lustre mounted without its flock option, some FUSE file systems) refuses
    with ENOSYS, EOPNOTSUPP or ENOLCK: the download goes on unlocked, with a warning. The lock only spares
    the dataset's host a second download: each node still downloads into a staging folder of its own and
    renames whole files into place, so no reader ever sees half a file either way."""
    with open(lock_path, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        except OSError as error:
            if error.errno not in NO_LOCKS:
                raise
            log.warning("%s: the file system has no file locks (%s; Lustre needs its flock mount option): nodes "
                        "that share this folder may each download the dataset, each into a staging folder of its own",
                        lock_path.parent, os.strerror(error.errno))
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _move_into_place(staging: Path, data_dir: Path) -> None:
    """Every file under staging to the same place under data_dir, each by one atomic rename."""
    for source in sorted(staging.rglob("*")):
        if source.is_file():
            target = data_dir / source.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)


@contextmanager
def _socket_timeout(seconds: float) -> Iterator[None]:
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)
