"""Fashion-MNIST as the trainer reads it, for the suite's in-process measurements and minimal loop."""

from __future__ import annotations

import torch

from trainer.data import ImageTensorDataset, load_datasets
from trainer.distributed import Runtime
from trainer.launchers import identity_from_env
from trainer.tasks import ClassificationOptions


def one_process_runtime() -> Runtime:
    """A world of one, without a process group: the data loading path needs none for a single process."""
    return Runtime(identity_from_env({}), torch.device("cpu"), "gloo")


def fashion_mnist_train() -> ImageTensorDataset:
    """The training split from the trainer's default location (the Debian package, else the shipped subset)."""
    train, _, _ = load_datasets(ClassificationOptions(dataset="fashion-mnist"), one_process_runtime())
    return train


def as_float_tensors(dataset: ImageTensorDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample normalised once, float32 [N,C,H,W] and int64 [N]: data already in memory as tensors."""
    return dataset.__getitems__(list(range(len(dataset))))
