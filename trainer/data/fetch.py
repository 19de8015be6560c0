"""Copy a dataset from an fsspec URL (s3://, gs://, file://, memory://...) into a local cache folder.

Runs on one rank per node. Each file is written under a temporary name and renamed into place,
so a crash mid-copy never leaves a partial file that a later run would take for a cached one,
and two nodes sharing a cache folder (a network home directory) never see each other's halves.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import uuid
from pathlib import Path

import fsspec

from trainer.data.catalog import DatasetSpec
from trainer.data.locate import FoundFile, find_files
from trainer.errors import DataError

log = logging.getLogger(__name__)
COPY_CHUNK = 8 << 20  # large reads: object stores answer each read with a request


def fetch(url: str, spec: DatasetSpec, folder: Path) -> None:
    """Make folder hold the dataset's files from url; files already there with the same size are kept."""
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as error:
        raise DataError(
            f"--data-dir {url}: no filesystem for this URL ({error}); install its fsspec package "
            f"(s3fs for s3://, gcsfs for gs://, adlfs for az://) or use a local folder"
        ) from None
    try:
        files = find_files(fs, root, spec, shown_as=url, hint="upload the dataset there or fix the URL")
    except OSError as error:
        raise DataError(f"--data-dir {url}: cannot list it ({error}); check the URL, credentials and network") from None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(
            f"cannot create the data cache {folder} ({error.strerror or error}); set --data-cache-dir to a "
            f"writable folder"
        ) from None
    copied = 0
    for found in files.values():
        local = folder / posixpath.basename(found.path)
        if found.size is not None and local.is_file() and local.stat().st_size == found.size:
            continue
        _copy(fs, found, local, url)
        copied += 1
    log.info("fetched %d of %d %s files from %s into %s", copied, len(files), spec.name, url, folder)


def _copy(fs: fsspec.AbstractFileSystem, found: FoundFile, local: Path, url: str) -> None:
    partial = local.with_name(f".{local.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part")
    try:
        with fs.open(found.path, "rb") as source, partial.open("wb") as target:
            shutil.copyfileobj(source, target, COPY_CHUNK)
        written = partial.stat().st_size
        if found.size is not None and written != found.size:
            raise DataError(
                f"--data-dir {url}: {found.path} is {found.size} bytes but the copy has {written}; "
                f"did it change during the copy? run again"
            )
        os.replace(partial, local)
    except OSError as error:
        raise DataError(f"--data-dir {url}: copying {found.path} to {local} failed ({error})") from None
    finally:
        partial.unlink(missing_ok=True)
