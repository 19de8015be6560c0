"""One node's --download, from a loopback server standing in for the dataset's host.

``python -m tests.workers.data_download FOLDER URL SITE``: points torchvision's MNIST at URL (its files, and
their MD5 sums, as served from the local folder SITE), then runs trainer.data.download.download into FOLDER.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torchvision.datasets

from trainer.data.catalog import SPECS
from trainer.data.download import download


def main(folder: str, url: str, site: str) -> None:
    served = sorted(Path(site).iterdir())
    torchvision.datasets.MNIST.mirrors = [url]
    torchvision.datasets.MNIST.resources = [(path.name, hashlib.md5(path.read_bytes()).hexdigest()) for path in served]
    download(SPECS["mnist"], Path(folder))


if __name__ == "__main__":
    main(*sys.argv[1:4])
