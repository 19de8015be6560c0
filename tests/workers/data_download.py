"""One node's --download, from a loopback server standing in for the dataset's host.

``python -m tests.workers.data_download FOLDER URL SITE [no-locks]``: points torchvision's MNIST at URL (its files,
and their MD5 sums, as served from the local folder SITE), then runs trainer.data.download.download into FOLDER.
``no-locks``: flock fails as on a Lustre file system mounted without its flock option (ENOSYS).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import sys
from pathlib import Path

import torchvision.datasets

from trainer.data.catalog import SPECS
from trainer.data.download import download


def main(folder: str, url: str, site: str, locks: str = "") -> None:
    if locks == "no-locks":
        fcntl.flock = _no_file_locks
    served = sorted(Path(site).iterdir())
    torchvision.datasets.MNIST.mirrors = [url]
    torchvision.datasets.MNIST.resources = [(path.name, hashlib.md5(path.read_bytes()).hexdigest()) for path in served]
    download(SPECS["mnist"], Path(folder))


def _no_file_locks(fd: int, operation: int) -> None:
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))


if __name__ == "__main__":
    main(*sys.argv[1:5])
