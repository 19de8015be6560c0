"""The real datasets: their files, where torchvision puts them, how to read them, how to normalise them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.data import cifar, idx
from trainer.data.dataset import DatasetInfo

Split = tuple[torch.Tensor, torch.Tensor]
# Reads the files named in DatasetSpec.files (name -> local path) into (train, test).
Reader = Callable[[Mapping[str, Path]], tuple[Split, Split]]


@dataclass(frozen=True)
class DatasetSpec:
    info: DatasetInfo
    mean: tuple[float, ...]
    std: tuple[float, ...]
    files: tuple[str, ...]  # every file the dataset needs, by its plain name
    suffixes: tuple[str, ...]  # accepted variants of each name, in order of preference
    subfolders: tuple[str, ...]  # torchvision's layout under --data-dir, tried after the folder itself
    torchvision_class: str  # the torchvision.datasets class that knows the download mirrors and checksums
    read: Reader

    @property
    def name(self) -> str:
        return self.info.name

    def describe_files(self) -> str:
        variants = "" if self.suffixes == ("",) else " (each plain or " + ", ".join(s for s in self.suffixes if s) + ")"
        return ", ".join(self.files) + variants


IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _read_idx_dataset(num_classes: int) -> Reader:
    def read(paths: Mapping[str, Path]) -> tuple[Split, Split]:
        train_images, train_labels, test_images, test_labels = (paths[name] for name in IDX_FILES)
        return (idx.read_images_and_labels(train_images, train_labels, num_classes),
                idx.read_images_and_labels(test_images, test_labels, num_classes))
    return read


def _read_cifar10(paths: Mapping[str, Path]) -> tuple[Split, Split]:
    return (cifar.read_batches([paths[name] for name in cifar.TRAIN_BATCHES]),
            cifar.read_batch(paths[cifar.TEST_BATCH]))


SPECS: dict[str, DatasetSpec] = {
    "fashion-mnist": DatasetSpec(
        DatasetInfo("fashion-mnist", 1, (28, 28), 10), (0.2860,), (0.3530,),
        IDX_FILES, ("", ".gz"), ("FashionMNIST/raw",), "FashionMNIST", _read_idx_dataset(10),
    ),
    "mnist": DatasetSpec(
        DatasetInfo("mnist", 1, (28, 28), 10), (0.1307,), (0.3081,),
        IDX_FILES, ("", ".gz"), ("MNIST/raw",), "MNIST", _read_idx_dataset(10),
    ),
    # The std of every pixel over the training set; the often-copied (0.2023, 0.1994, 0.2010) is
    # the mean of per-image stds, which under-normalises.
    "cifar10": DatasetSpec(
        DatasetInfo("cifar10", 3, (32, 32), 10), (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616),
        (*cifar.TRAIN_BATCHES, cifar.TEST_BATCH), ("",), ("cifar-10-batches-py",), "CIFAR10", _read_cifar10,
    ),
}
