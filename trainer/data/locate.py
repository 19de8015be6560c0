"""Where a dataset's files are: the default folder, torchvision's layouts, local folders and URLs alike."""

from __future__ import annotations

import hashlib
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

import fsspec
from fsspec import AbstractFileSystem

from trainer.data.catalog import SPECS, DatasetSpec
from trainer.errors import DataError
from trainer.redact import redact

# Installed by the Debian package dataset-fashion-mnist: the full dataset, gzipped IDX.
SYSTEM_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
# A real 5000/1000 subset shipped inside the package, so that the default run needs no network.
SHIPPED_FASHION_MNIST = Path(__file__).resolve().parent / "fashion_mnist_subset"
DEFAULT_CACHE = "~/.cache/ddp-deploy/data"


@dataclass(frozen=True)
class FoundFile:
    path: str  # in the filesystem's own notation
    size: int | None  # None where the filesystem cannot tell (some HTTP servers)


def is_url(data_dir: str) -> bool:
    return "://" in data_dir


def default_data_dir(dataset: str, system_dir: Path = SYSTEM_FASHION_MNIST) -> str:
    """The folder an empty --data-dir means: "" for synthetic, which has no files."""
    if dataset == "synthetic":
        return ""
    if dataset == "fashion-mnist":
        has_system_copy = holds_dataset(local_filesystem(), str(system_dir), SPECS[dataset])
        return str(system_dir if has_system_copy else SHIPPED_FASHION_MNIST)
    raise DataError(
        f"--dataset {dataset} needs --data-dir: the folder or URL that holds it, "
        f"or a local folder to download it into with --download"
    )


def holds_dataset(fs: AbstractFileSystem, root: str, spec: DatasetSpec) -> bool:
    return bool(_scan(fs, root, spec)[0])


def find_files(fs: AbstractFileSystem, root: str, spec: DatasetSpec, shown_as: str, hint: str) -> dict[str, FoundFile]:
    """Every file of the dataset, from root itself or one of torchvision's subfolders; DataError if incomplete.

    shown_as is how the user wrote root (--data-dir's value); hint says what to do when nothing is there.
    """
    complete, partial = _scan(fs, root, spec)
    if complete:
        return complete
    if not fs.exists(root):
        raise DataError(f"--data-dir {shown_as} does not exist; {hint}")
    if partial:
        folder, found = partial
        missing = [name for name in spec.files if name not in found]
        raise DataError(
            f"--data-dir {shown_as}: {folder} holds part of {spec.name} but lacks {', '.join(missing)}; "
            f"copy the missing files there or fetch the dataset again"
        )
    places = " or ".join([shown_as, *(f"{shown_as.rstrip('/')}/{sub}" for sub in spec.subfolders)])
    raise DataError(f"--data-dir {shown_as}: no {spec.name} files; expected {spec.describe_files()} in {places}; "
                    f"{hint}")


def cache_folder(url: str, cache_dir: str) -> Path:
    """A folder per URL: readable name for people, hash so that different URLs never share one. Both from
    the URL without its password and query values, so that no credential (nor its hash) is in a name."""
    shown = redact(url)
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", shown).strip("_")[:80]
    digest = hashlib.sha256(shown.encode()).hexdigest()[:16]
    return Path(cache_dir or DEFAULT_CACHE).expanduser() / f"{readable}-{digest}"


def _scan(fs: AbstractFileSystem, root: str, spec: DatasetSpec
          ) -> tuple[dict[str, FoundFile], tuple[str, dict[str, FoundFile]] | None]:
    """(the files of the first complete folder or {}, the most complete partial folder or None)."""
    best: tuple[str, dict[str, FoundFile]] | None = None
    for folder in (root, *(posixpath.join(root, sub) for sub in spec.subfolders)):
        found = _match(_list_files(fs, folder), spec)
        if len(found) == len(spec.files):
            return found, None
        if found and (best is None or len(found) > len(best[1])):
            best = (folder, found)
    return {}, best


def _list_files(fs: AbstractFileSystem, folder: str) -> dict[str, FoundFile]:
    """File name -> file, in one listing: on object stores that is one request, not one per candidate name."""
    try:
        entries = fs.ls(folder, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {posixpath.basename(entry["name"].rstrip("/")): FoundFile(entry["name"], entry.get("size"))
            for entry in entries if entry.get("type") == "file"}


def _match(listing: dict[str, FoundFile], spec: DatasetSpec) -> dict[str, FoundFile]:
    found = {}
    for name in spec.files:
        for suffix in spec.suffixes:
            if name + suffix in listing:
                found[name] = listing[name + suffix]
                break
    return found


def local_filesystem() -> AbstractFileSystem:
    return fsspec.filesystem("file")
