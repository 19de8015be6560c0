"""The built-in task's sharded images (``--dataset shards``): each sample an image member (``.jpg``, ``.png``,
``.webp``...) and its class in a ``.cls`` member (the class index as text), WebDataset's usual layout."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch

from trainer.data.dataset import DatasetInfo, Normalise
from trainer.data.imagefolder import MEAN, STD, decode_image
from trainer.data.jpeg_bytes import JpegBytes, for_device
from trainer.data.shards.dataset import Members, ShardedDataset
from trainer.errors import DataError

__all__ = ["IMAGE_EXTENSIONS", "ImageSample", "image_info", "image_normalise"]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "ppm", "tif", "tiff")


@dataclass(frozen=True)
class ImageSample:
    """A sample's members -> (uint8 C,H,W image, class index); normalised on the device (image_normalise)."""

    image_size: int
    mode: str  # "RGB" or "L"
    # --image-decode device: a JPEG member is left undecoded (trainer.data.jpeg_bytes), for the device to decode.
    decode_on_device: bool = False

    def __call__(self, members: Members) -> tuple[torch.Tensor | JpegBytes, torch.Tensor]:
        extension = next((name for name in IMAGE_EXTENSIONS if name in members), None)
        if extension is None:
            raise DataError(f"no image member (it has {', '.join('.' + name for name in members) or 'none'}; "
                            f"expected one of {', '.join('.' + name for name in IMAGE_EXTENSIONS)})")
        if "cls" not in members:
            raise DataError("no .cls member (the class index as text)")
        try:
            label = int(members["cls"].decode().strip())
        except (UnicodeDecodeError, ValueError):
            raise DataError(f"its .cls member is {members['cls'][:20]!r}, not a class index") from None
        where = f"its .{extension} member"
        encoded = for_device(members[extension], where) if self.decode_on_device else None
        image = encoded or decode_image(io.BytesIO(members[extension]), self.image_size, where, self.mode)
        return image, torch.tensor(label)


def image_info(dataset: ShardedDataset, image_size: int) -> DatasetInfo:
    """What the model needs to know, from the index's info (ddp-shard writes it): classes, channels, image size
    (where the index fixes none, --image-size)."""
    info = dataset.info
    classes = info.get("num_classes")
    if not isinstance(classes, int) or classes < 2:
        raise DataError(f"{dataset.store.where('index.json')}: its info has no num_classes (got {classes!r}); "
                        f"--dataset shards needs it: write the shards with ddp-shard, or index them with "
                        f"ddp-shard index, which counts the .cls labels")
    channels = int(info.get("channels", 3))
    if channels not in (1, 3):
        raise DataError(f"{dataset.store.where('index.json')}: channels {channels}; images have 1 or 3")
    size = int(info.get("image_size") or image_size)
    return DatasetInfo("shards", channels, (size, size), classes)


def image_normalise(info: dict[str, Any], channels: int) -> Normalise:
    """The index's mean and std where it has them, else ImageNet's (grey: their averages)."""
    mean, std = info.get("mean"), info.get("std")
    if mean and std:
        return Normalise(tuple(mean), tuple(std))
    if channels == 1:
        return Normalise((sum(MEAN) / 3,), (sum(STD) / 3,))
    return Normalise(MEAN, STD)
