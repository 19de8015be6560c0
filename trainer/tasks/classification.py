"""The built-in task: image classification with the datasets and models the trainer ships.

Its options are the flags --dataset, --data-dir, --model and the others below; its loss is
cross-entropy and its metric accuracy. It is an ordinary task: what it does, a user's task can do.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor, nn

from trainer.data import DATASETS, ImageFolderDataset, ImageTensorDataset, collate_batch, load_datasets
from trainer.data.dataset import DatasetInfo
from trainer.data.device_decode import IMAGE_DECODE_PLACES, DeviceDecode
from trainer.data.jpeg_bytes import collate_for_device_decode
from trainer.data.shards import ShardedDataset
from trainer.data.shards.images import image_normalise
from trainer.errors import ConfigError
from trainer.metrics import Accuracy
from trainer.models import MODELS, build_model
from trainer.options import ResumeRule, check, check_choice, option
from trainer.task import Task, TaskContext, TaskData

log = logging.getLogger(__name__)
REFUSE = ResumeRule.REFUSE
# The datasets read from image files, which --image-decode device can decode on the device.
DECODED_DATASETS = ("imagefolder", "shards")


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
    image_decode: str = option(
        "workers",
        "imagefolder and shards: where JPEG images are decoded: 'workers' (Pillow, in the DataLoader workers) or "
        "'device' (the workers read the bytes; each batch is decoded on the training device, by nvJPEG on a GPU, "
        "then resized and cropped there; other formats and CMYK JPEGs are still decoded in the workers)",
        IMAGE_DECODE_PLACES, resume=ResumeRule.FLAG)
    model: str = option("convnet", "model architecture", MODELS, resume=REFUSE)
    pretrained: bool = option(False, "torchvision/<name> models: start from torchvision's pretrained weights")

    def __post_init__(self) -> None:
        check_choice(self.dataset, "dataset", DATASETS)
        check_choice(self.model, "model", MODELS)
        check_choice(self.image_decode, "image_decode", IMAGE_DECODE_PLACES)
        check(self.image_decode == "workers" or self.dataset in DECODED_DATASETS,
              f"--image-decode device decodes image files: it applies to --dataset "
              f"{' or '.join(DECODED_DATASETS)}, and --dataset {self.dataset} is read decoded already; drop the flag")
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
        if self.options.image_decode == "device":
            return self._decoded_on_device(train, test, info, context)
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

    def _decoded_on_device(self, train: Any, test: Any, info: DatasetInfo, context: TaskContext) -> TaskData:
        """--image-decode device: the workers hand over JPEG bytes, decoded a batch at a time on the device."""
        if isinstance(train, ShardedDataset):
            for split in (train, test):
                split.decode = replace(split.decode, decode_on_device=True)
            normalise = image_normalise(train.info, info.in_channels)
        else:
            train, test = train.encoded(), test.encoded()
            normalise = train.normalise
        device = context.runtime.device
        decode = DeviceDecode(device, info.image_size[0], info.in_channels == 1, normalise)
        decoder = "nvJPEG" if device.type == "cuda" else "torchvision's decoder"
        if context.runtime.identity.rank == 0:
            log.info("--image-decode device: the workers read JPEG files' bytes; each batch is decoded on %s (%s), "
                     "resized and cropped there; other formats and CMYK JPEGs are decoded in the workers", device,
                     decoder)
        return TaskData(train, test, info, collate_fn=collate_for_device_decode, deterministic_items=True,
                        on_device=decode)

    def model(self, data: TaskData) -> nn.Module:
        info = data.info
        return build_model(self.options.model, info.in_channels, info.image_size, info.num_classes,
                           self.options.pretrained)

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return nn.functional.cross_entropy(outputs.float(), targets)

    def metrics(self) -> Mapping[str, Any]:
        return {"accuracy": Accuracy()}


