"""The built-in task: image classification with the datasets and models the trainer ships.

Its options are the flags --dataset, --data-dir, --model and the others below; its loss is
cross-entropy and its metric accuracy. It is an ordinary task: what it does, a user's task can do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from trainer.data import DATASETS, ImageFolderDataset, ImageTensorDataset, collate_batch, load_datasets
from trainer.data.shards import ShardedDataset
from trainer.data.shards.images import image_normalise
from trainer.errors import ConfigError
from trainer.metrics import Accuracy
from trainer.models import MODELS, build_model
from trainer.options import ResumeRule, check, check_choice, option
from trainer.task import Task, TaskContext, TaskData

REFUSE = ResumeRule.REFUSE


@dataclass
class ClassificationOptions:
    dataset: str = option("fashion-mnist", "dataset to train on", DATASETS, resume=REFUSE)
    data_dir: str = option(
        "",
        "dataset folder or fsspec URL (s3://, memory://, file://); empty: the Debian package's Fashion-MNIST if "
        "installed, else the small subset shipped with the repository")
    download: bool = option(False, "download the dataset into --data-dir if it is missing")
    data_cache_dir: str = option("", "local cache for datasets fetched from a URL (default: ~/.cache/ddp-deploy/data); "
                                     "given, synthetic datasets are kept there too, generated once")
    image_size: int = option(224, "imagefolder: the shorter side is resized to this, then a centred square is "
                                  "cropped", resume=REFUSE)
    eval_fraction: float = option(0.1, "imagefolder without train/ and val/ folders: share of each class held "
                                       "out for evaluation, chosen with --seed", resume=REFUSE)
    synthetic_shape: str = option("1,28,28", "synthetic dataset: image shape C,H,W", resume=REFUSE)
    synthetic_train_size: int = option(2048, "synthetic dataset: number of training samples", resume=REFUSE)
    synthetic_test_size: int = option(512, "synthetic dataset: number of test samples", resume=REFUSE)
    synthetic_classes: int = option(10, "synthetic dataset: number of classes", resume=REFUSE)
    model: str = option("convnet", "model architecture", MODELS, resume=REFUSE)
    pretrained: bool = option(False, "torchvision/<name> models: start from torchvision's pretrained weights")

    def __post_init__(self) -> None:
        check_choice(self.dataset, "dataset", DATASETS)
        check_choice(self.model, "model", MODELS)
        check(self.image_size >= 8, f"--image-size must be >= 8, got {self.image_size}")
        check(0 <= self.eval_fraction < 1, f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        self.synthetic_image_shape()  # validates the string
        check(self.synthetic_train_size > 0 and self.synthetic_test_size > 0, "synthetic sizes must be > 0")
        check(self.synthetic_classes >= 2, "--synthetic-classes must be >= 2")

    def synthetic_image_shape(self) -> tuple[int, int, int]:
        try:
            c, h, w = (int(part) for part in self.synthetic_shape.split(","))
        except ValueError:
            raise ConfigError(
                f"--synthetic-shape {self.synthetic_shape!r}: expected three integers C,H,W such as 3,32,32"
            ) from None
        check(min(c, h, w) > 0, f"--synthetic-shape {self.synthetic_shape!r}: sizes must be positive")
        return c, h, w


class ImageClassification(Task[ClassificationOptions]):
    """Images in, class scores out: cross-entropy loss, accuracy."""

    name = "classification"
    Options = ClassificationOptions
    monitor, monitor_mode = "accuracy", "max"

    def datasets(self, context: TaskContext) -> TaskData:
        train, test, info = load_datasets(self.options, context.runtime, context.seed)
        in_memory = isinstance(train, ImageTensorDataset)
        on_device = None
        if isinstance(train, ShardedDataset):  # uint8 images, normalised on the device
            on_device = image_normalise(train.info, info.in_channels)
        elif isinstance(train, ImageTensorDataset | ImageFolderDataset) and type(test) is type(train):
            # uint8 images cross to the device and are normalised there, as a careful hand-written loop does (a
            # dataset registered in DATASETS by a user is taken as it comes).
            train, test = train.raw(), test.raw()
            on_device = train.normalise
        # Whole splits held as tensors are indexed a batch at a time (ImageTensorDataset.__getitems__).
        return TaskData(train, test, info, collate_fn=collate_batch if in_memory else None,
                        deterministic_items=True, in_memory=in_memory, on_device=on_device)

    def model(self, data: TaskData) -> nn.Module:
        info = data.info
        return build_model(self.options.model, info.in_channels, info.image_size, info.num_classes,
                           self.options.pretrained)

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return nn.functional.cross_entropy(outputs.float(), targets)

    def metrics(self) -> Mapping[str, Any]:
        return {"accuracy": Accuracy()}


