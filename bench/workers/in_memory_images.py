"""The reference of figure 9: the image folder's images decoded once into memory, as a task.

``--task bench.workers.in_memory_images:InMemoryImages --data-dir DIR --image-size 64``: the very images
``--dataset imagefolder`` would read (decoded and resized by the same code), held as one uint8 tensor and
normalised on the device as the folder's are, so that the figure compares loading from JPEG files with no
loading at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from trainer.data import ImageFolderDataset, load_datasets
from trainer.metrics import Accuracy
from trainer.models import build_model
from trainer.options import option
from trainer.task import Task, TaskContext, TaskData
from trainer.tasks import ClassificationOptions


@dataclass
class InMemoryOptions:
    data_dir: str = option("", "the image folder")
    image_size: int = option(64, "side of the square images")
    model: str = option("torchvision/resnet18", "model, as --model")


class Decoded(torch.utils.data.Dataset[tuple[Tensor, Tensor]]):
    """Images and labels as tensors; a batch is one indexing operation."""

    def __init__(self, folder: ImageFolderDataset) -> None:
        self.images = torch.stack([folder.image(index) for index in range(len(folder))])
        self.labels = folder.labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        rows = torch.as_tensor(indices)
        return self.images[rows], self.labels[rows]


def _batch(batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    return batch


class InMemoryImages(Task[InMemoryOptions]):
    name = "in-memory-images"
    Options = InMemoryOptions

    def datasets(self, context: TaskContext) -> TaskData:
        options = ClassificationOptions(dataset="imagefolder", data_dir=str(Path(self.options.data_dir)),
                                        image_size=self.options.image_size)
        train, test, info = load_datasets(options, context.runtime, context.seed)
        train, test = train.raw(), test.raw()
        return TaskData(Decoded(train), Decoded(test), info, collate_fn=_batch, deterministic_items=True,
                        in_memory=True, on_device=train.normalise)

    def model(self, data: TaskData) -> nn.Module:
        info = data.info
        return build_model(self.options.model, info.in_channels, info.image_size, info.num_classes)

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return nn.functional.cross_entropy(outputs.float(), targets)

    def metrics(self) -> Mapping[str, Any]:
        return {"accuracy": Accuracy()}
