"""--download: torchvision's dataset classes fetch the files; they know the mirrors and checksums."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainer.data.catalog import DatasetSpec
from trainer.errors import DataError

log = logging.getLogger(__name__)
# torchvision opens URLs without a timeout: a connection that a firewall silently drops would stall
# this rank for ever while the other ranks wait for it. Per connect and per read, not for the whole file.
SOCKET_TIMEOUT_S = 60.0


def download(spec: DatasetSpec, data_dir: Path) -> None:
    """Download spec's dataset into data_dir in torchvision's layout (e.g. data_dir/FashionMNIST/raw)."""
    # Imported here: torchvision costs a second at start-up, and only --download needs it.
    import torchvision.datasets

    dataset_class = getattr(torchvision.datasets, spec.torchvision_class)
    log.info("downloading %s into %s", spec.name, data_dir)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        with _socket_timeout(SOCKET_TIMEOUT_S):
            # Downloads every split (torchvision fetches all files whatever `train` says); the test
            # split is the smaller one to load as a check.
            dataset_class(str(data_dir), train=False, download=True)
    except (RuntimeError, OSError) as error:
        reason = " ".join(str(error).split())  # torchvision's message spans lines, one per mirror tried
        raise DataError(
            f"--download: could not download {spec.name} into {data_dir}: {reason}. Without internet access, "
            f"copy {spec.describe_files()} into {data_dir} and run without --download"
        ) from None


@contextmanager
def _socket_timeout(seconds: float) -> Iterator[None]:
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)
