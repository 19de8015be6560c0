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
from trainer.errors import DataError, described

log = logging.getLogger(__name__)
COPY_CHUNK = 8 << 20  # large reads: object stores answer each read with a request


def open_url(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of a --data-dir URL. Some filesystems connect and log in here (ftp, sftp):
    a refused connection or a wrong password is a data error, as missing data is."""
    try:
        return fsspec.core.url_to_fs(url)  # type: ignore[no-any-return]
    except (ImportError, ValueError) as error:
        raise DataError(
            f"--data-dir {url}: no filesystem for this URL ({error}); install its fsspec package "
            f"(s3fs for s3://, gcsfs for gs://, adlfs for az://) or use a local folder"
        ) from None
    except Exception as error:  # noqa: BLE001 - each filesystem has its own errors (ftplib.error_perm, ...)
        raise unreachable(url, error) from None


def unreachable(url: str, error: BaseException) -> DataError:
    return DataError(f"--data-dir {url}: cannot reach it ({described(error)}); check the URL, credentials and "
                     f"network")


def fetch(url: str, spec: DatasetSpec, folder: Path) -> None:
    """Make folder hold the dataset's files from url; files already there with the same size are kept."""
    fs, root = open_url(url)
    try:
        files = find_files(fs, root, spec, shown_as=url, hint="upload the dataset there or fix the URL")
    except DataError:
        raise
    except Exception as error:  # noqa: BLE001 - an HTTP 401 is no OSError
        raise unreachable(url, error) from None
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
