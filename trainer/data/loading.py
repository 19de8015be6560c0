"""The datasets --dataset names, and loading one: resolve where it lives, fetch or download it once per
node, read it on every rank.

Every step that can fail on some ranks only ends in an agreement (trainer.distributed.agree), so a
missing file on one node becomes the same DataError on every rank instead of a hang in the
first collective of the training loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from trainer.data.catalog import SPECS, DatasetSpec
from trainer.data.dataset import DatasetInfo, ImageTensorDataset
from trainer.data.download import download
from trainer.data.fetch import fetch
from trainer.data.imagefolder import fetch_tree, load_imagefolder
from trainer.data.locate import (
    cache_folder,
    default_data_dir,
    find_files,
    holds_dataset,
    is_url,
    local_filesystem,
)
from trainer.data.shards.dataset import ShardedDataset
from trainer.data.shards.images import ImageSample, image_info
from trainer.data.synthetic import cached_synthetic, make_synthetic
from trainer.distributed import Runtime, agreed
from trainer.errors import DataError
from trainer.registry import Registry

log = logging.getLogger(__name__)
T = TypeVar("T")
Splits = tuple[Dataset[Any], Dataset[Any], DatasetInfo]
# (the classification task's options, the group, the seed) -> (train, evaluation, info)
DatasetLoader = Callable[[Any, Runtime, int], Splits]


def load_datasets(options: Any, runtime: Runtime, seed: int = 0) -> Splits:
    """(train, test, info) for options.dataset, identical on every rank; DataError on every rank if any failed."""
    return DATASETS.get(options.dataset)(options, runtime, seed)


def _load_files(spec: DatasetSpec, options: Any, runtime: Runtime, seed: int) -> Splits:
    """A dataset of known files (IDX, CIFAR batches), read whole into memory."""
    data_dir = options.data_dir or default_data_dir(spec.name)
    folder = _prepare(options, spec, data_dir, runtime)
    train, test = _agreed(runtime, lambda: _read(spec, folder))
    _check_same_sizes(runtime, len(train), len(test), data_dir, defaulted=not options.data_dir)
    if runtime.identity.is_main:
        log.info("%s from %s: %d training and %d test images", spec.name, data_dir, len(train), len(test))
    return train, test, spec.info


def _load_synthetic(options: Any, runtime: Runtime, seed: int) -> Splits:
    sizes = (options.synthetic_image_shape(), options.synthetic_classes, options.synthetic_train_size,
             options.synthetic_test_size)
    if not options.data_cache_dir:
        return make_synthetic(*sizes)
    # Made once per node into the cache (by its local-main rank), then read by the node's other ranks.
    folder = Path(options.data_cache_dir).expanduser()
    local_main = runtime.identity.is_local_main
    made = _agreed(runtime, (lambda: cached_synthetic(folder, *sizes)) if local_main else _nothing)
    return _agreed(runtime, (lambda: made) if local_main else (lambda: cached_synthetic(folder, *sizes)))


def _load_imagefolder(options: Any, runtime: Runtime, seed: int) -> Splits:
    if not options.data_dir:
        raise DataError("--dataset imagefolder needs --data-dir: a folder (or URL) with one subfolder of images "
                        "per class")
    folder = Path(options.data_dir).expanduser()
    if is_url(options.data_dir):
        folder = cache_folder(options.data_dir, options.data_cache_dir)
        local_main = runtime.identity.is_local_main
        _agreed(runtime, (lambda: fetch_tree(options.data_dir, folder)) if local_main else _nothing)
    train, test, info = _agreed(runtime, lambda: load_imagefolder(folder, options.image_size, options.eval_fraction,
                                                                  seed))
    _check_same_sizes(runtime, len(train), len(test), options.data_dir, defaulted=False)
    return train, test, info


def _load_shards(options: Any, runtime: Runtime, seed: int) -> Splits:
    if not options.data_dir:
        raise DataError("--dataset shards needs --data-dir: the folder or URL (s3://bucket/prefix) that holds "
                        "index.json and the tar shards; write them with ddp-shard")

    def open_splits() -> Splits:
        train, evaluation = ShardedDataset.splits(options.data_dir, ("train", "eval"))
        info = image_info(train, options.image_size)
        train.decode = evaluation.decode = ImageSample(info.image_size[0], "L" if info.in_channels == 1 else "RGB")
        return train, evaluation, info

    train, test, info = _agreed(runtime, open_splits)
    if runtime.identity.is_main:
        log.info("shards at %s: %d training samples in %d shards, %d evaluation samples, %d classes",
                 train.store.shown, len(train), len(train.shards), len(test), info.num_classes)
    return train, test, info


DATASETS: Registry[DatasetLoader] = Registry("dataset", "--dataset")
for _spec in SPECS.values():
    DATASETS.add(_spec.name, partial(_load_files, _spec), f"{_spec.name} files ({_spec.describe_files()})")
DATASETS.add("synthetic", _load_synthetic, "generated images of any shape (--synthetic-*), learnable")
DATASETS.add("imagefolder", _load_imagefolder, "one folder of JPEG/PNG images per class (local or a URL)")
DATASETS.add("shards", _load_shards, "WebDataset tar shards (.jpg/.png + .cls) with an index, streamed from a folder "
             "or URL (ddp-shard writes them)")


def _prepare(options: Any, spec: DatasetSpec, data_dir: str, runtime: Runtime) -> Path:
    """The local folder to read from, after this node's local-main rank fetched or downloaded into it."""
    local_main = runtime.identity.is_local_main
    if is_url(data_dir):
        if options.download:
            raise DataError(f"--download writes into a local folder, but --data-dir is the URL {data_dir}; "
                            f"upload the dataset there, or download into a local --data-dir")
        folder = cache_folder(data_dir, options.data_cache_dir)
        _agreed(runtime, (lambda: fetch(data_dir, spec, folder)) if local_main else _nothing)
        return folder
    folder = Path(data_dir).expanduser()
    if options.download:
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
    """Run step here, then agree: any rank's failure is raised on every rank, as a DataError. Each of these
    steps (fetching, downloading, reading files) may take longer than --collective-timeout-s on some rank:
    the others wait for it while it is alive (trainer.liveness)."""
    return agreed(runtime, step, DataError, long_work="the dataset (fetched, downloaded or read on each node)")


def _check_same_sizes(runtime: Runtime, train_size: int, test_size: int, data_dir: str, defaulted: bool) -> None:
    """Nodes can resolve the same flags to different files (one has the Debian package, another not)."""
    if not runtime.identity.distributed:
        return
    sizes = torch.tensor([train_size, test_size, -train_size, -test_size], dtype=torch.int64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=runtime.control)
    largest, smallest = sizes[:2].tolist(), (-sizes[2:]).tolist()
    if largest != smallest:
        fix = ("install dataset-fashion-mnist on every node or on none, or pass --data-dir" if defaulted
               else "every node must hold the same files there")
        raise DataError(
            f"ranks read different datasets (this rank from {data_dir}): training sets of {smallest[0]} to "
            f"{largest[0]} images, test sets of {smallest[1]} to {largest[1]}; {fix}"
        )
