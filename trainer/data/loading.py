"""load_datasets: resolve where the data lives, fetch or download it once per node, read it on every rank.

Every step that can fail on some ranks only ends in an agreement (trainer.distributed.agree), so a
missing file on one node becomes the same DataError on every rank instead of a hang in the
first collective of the training loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from trainer.config import DataConfig
from trainer.data.catalog import SPECS, DatasetSpec
from trainer.data.dataset import DatasetInfo, ImageTensorDataset
from trainer.data.download import download
from trainer.data.fetch import fetch
from trainer.data.locate import (
    cache_folder,
    default_data_dir,
    find_files,
    holds_dataset,
    is_url,
    local_filesystem,
)
from trainer.data.synthetic import make_synthetic
from trainer.distributed import Runtime, agree
from trainer.errors import DataError

log = logging.getLogger(__name__)
T = TypeVar("T")


def load_datasets(config: DataConfig, runtime: Runtime) -> tuple[ImageTensorDataset, ImageTensorDataset, DatasetInfo]:
    """(train, test, info) for config.dataset, identical on every rank; DataError on every rank if any failed."""
    if config.dataset == "synthetic":
        train, test, info = make_synthetic(config.synthetic_image_shape(), config.synthetic_classes,
                                           config.synthetic_train_size, config.synthetic_test_size)
    else:
        spec = SPECS[config.dataset]
        data_dir = config.data_dir or default_data_dir(config.dataset)
        folder = _prepare(config, spec, data_dir, runtime)
        train, test = _agreed(runtime, lambda: _read(spec, folder))
        _check_same_sizes(runtime, len(train), len(test), data_dir, defaulted=not config.data_dir)
        info = spec.info
        if runtime.identity.is_main:
            log.info("%s from %s: %d training and %d test images", spec.name, data_dir, len(train), len(test))
    if config.max_train_samples:
        train = train.head(config.max_train_samples)
    if config.max_test_samples:
        test = test.head(config.max_test_samples)
    return train, test, info


def _prepare(config: DataConfig, spec: DatasetSpec, data_dir: str, runtime: Runtime) -> Path:
    """The local folder to read from, after this node's local-main rank fetched or downloaded into it."""
    local_main = runtime.identity.is_local_main
    if is_url(data_dir):
        if config.download:
            raise DataError(f"--download writes into a local folder, but --data-dir is the URL {data_dir}; "
                            f"upload the dataset there, or download into a local --data-dir")
        folder = cache_folder(data_dir, config.data_cache_dir)
        _agreed(runtime, (lambda: fetch(data_dir, spec, folder)) if local_main else _nothing)
        return folder
    folder = Path(data_dir).expanduser()
    if config.download:
        _agreed(runtime, (lambda: _download_if_missing(spec, folder)) if local_main else _nothing)
    return folder


def _nothing() -> None:
    """The step of the ranks that only wait for their node's local-main rank."""


def _download_if_missing(spec: DatasetSpec, folder: Path) -> None:
    if not holds_dataset(local_filesystem(), str(folder), spec):
        download(spec, folder)


def _read(spec: DatasetSpec, folder: Path) -> tuple[ImageTensorDataset, ImageTensorDataset]:
    files = find_files(local_filesystem(), str(folder), spec, shown_as=str(folder),
                       hint="pass --download to download it there, or point --data-dir at the folder that holds it")
    (train_images, train_labels), (test_images, test_labels) = spec.read({n: Path(f.path) for n, f in files.items()})
    return (ImageTensorDataset(train_images, train_labels, spec.mean, spec.std),
            ImageTensorDataset(test_images, test_labels, spec.mean, spec.std))


def _agreed(runtime: Runtime, step: Callable[[], T]) -> T:
    """Run step here, then agree: any rank's failure is raised on every rank."""
    try:
        value = step()
    except Exception as error:  # every failure must reach the agreement, or the other ranks hang in it
        _fail_everywhere(runtime, error)
    if runtime.identity.distributed and not agree(True, runtime.device):
        _fail_everywhere(runtime, None)
    return value


def _fail_everywhere(runtime: Runtime, error: Exception | None) -> NoReturn:
    """Raise the lowest failing rank's DataError on every rank.

    An unexpected exception (a bug, not bad data) keeps its traceback on the rank where it happened.
    """
    if error is not None and not runtime.identity.distributed:
        raise error
    if error is not None:
        agree(False, runtime.device)
    reports: list[str | None] = [None] * runtime.identity.world_size
    dist.all_gather_object(reports, None if error is None else _describe(error, runtime))
    if error is not None and not isinstance(error, DataError):
        raise error
    raise DataError(next(report for report in reports if report is not None))


def _describe(error: Exception, runtime: Runtime) -> str:
    where = f"rank {runtime.identity.rank} on {runtime.identity.hostname}"
    if isinstance(error, DataError):
        return f"{error} (seen by {where})"
    return f"{where} failed while loading the data: {type(error).__name__}: {error}"


def _check_same_sizes(runtime: Runtime, train_size: int, test_size: int, data_dir: str, defaulted: bool) -> None:
    """Nodes can resolve the same flags to different files (one has the Debian package, another not)."""
    if not runtime.identity.distributed:
        return
    sizes = torch.tensor([train_size, test_size, -train_size, -test_size], dtype=torch.int64, device=runtime.device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    largest, smallest = sizes[:2].tolist(), (-sizes[2:]).tolist()
    if largest != smallest:
        fix = ("install dataset-fashion-mnist on every node or on none, or pass --data-dir" if defaulted
               else "every node must hold the same files there")
        raise DataError(
            f"ranks read different datasets (this rank from {data_dir}): training sets of {smallest[0]} to "
            f"{largest[0]} images, test sets of {smallest[1]} to {largest[1]}; {fix}"
        )
