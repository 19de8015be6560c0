"""``--dataset imagefolder``: torchvision's folder-per-class layout of image files, decoded lazily.

    DATA_DIR/<class>/<image>             split into train and evaluation by a seeded fraction, or
    DATA_DIR/train/<class>/<image>       split by folder (val/, validation/ or test/ for evaluation)
    DATA_DIR/val/<class>/<image>

Files are JPEG, PNG, BMP, GIF or WebP; classes are the folder names in sorted order, as torchvision's
ImageFolder numbers them. Images are decoded (with Pillow) when an item is fetched, so in DataLoader
workers: RGB, the shorter side resized to --image-size, then a centre crop to a square, as uint8; the built-in
task normalises it on the device, after the copy (trainer.data.dataset.Normalise). DATA_DIR may be an fsspec
URL: one rank per node copies the tree into the local cache first, each file written under a
temporary name and renamed, so no reader ever sees half a file. With --image-decode device a worker only reads
a JPEG file's bytes, and the batch is decoded on the device (trainer.data.device_decode).
"""

from __future__ import annotations

import io
import logging
import os
import posixpath
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.data.dataset import DatasetInfo, Normalise
from trainer.data.jpeg_bytes import JpegBytes, for_device
from trainer.errors import DataError

log = logging.getLogger(__name__)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")
EVAL_FOLDERS = ("val", "validation", "test")
# ImageNet's statistics: what torchvision's pretrained weights were trained with.
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
COPY_CHUNK = 8 << 20


class ImageFolderDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Image files and their class indices; an item is the decoded, resized, normalised image and its label
    (with ``normalise_on_device``: the uint8 image, for ``normalise`` on the device after the copy)."""

    def __init__(self, files: Sequence[Path], labels: Sequence[int], image_size: int,
                 normalise_on_device: bool = False, decode_on_device: bool = False) -> None:
        self.files = [str(path) for path in files]
        self.labels = torch.as_tensor(list(labels), dtype=torch.int64)
        self.image_size = image_size
        self.normalise = Normalise(MEAN, STD)
        self.normalise_on_device = normalise_on_device or decode_on_device
        self.decode_on_device = decode_on_device

    def raw(self) -> ImageFolderDataset:
        """The same images as uint8, for ``normalise`` on the device after the copy."""
        return ImageFolderDataset(self.files, self.labels.tolist(), self.image_size, normalise_on_device=True)

    def encoded(self) -> ImageFolderDataset:
        """The same images with each JPEG left undecoded (trainer.data.jpeg_bytes.JpegBytes), for the device to
        decode (--image-decode device); other files decoded here, as uint8."""
        return ImageFolderDataset(self.files, self.labels.tolist(), self.image_size, decode_on_device=True)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.image(index), self.labels[index]

    def image(self, index: int) -> torch.Tensor | JpegBytes:
        path = self.files[index]
        if self.decode_on_device:
            try:
                data = Path(path).read_bytes()
            except OSError as error:
                raise DataError(f"{path}: not readable ({error.strerror or error}); replace or remove the file"
                                ) from None
            return for_device(data, path) or decode_image(io.BytesIO(data), self.image_size, path)
        pixels = decode_image(path, self.image_size, path)
        return pixels if self.normalise_on_device else self.normalise(pixels)


def decode_image(source: str | IO[bytes], size: int, where: str, mode: str = "RGB") -> torch.Tensor:
    """An image file (a path or an open binary file) as a uint8 C,H,W tensor: the shorter side resized to ``size``,
    then a centred square crop; ``mode`` "RGB" (3 channels) or "L" (1)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(source) as opened:
            # JPEG can decode straight at a fraction of its size: far less work for large photos.
            opened.draft(mode, (size, size))
            image = opened.convert(mode)
    except (OSError, UnidentifiedImageError, ValueError) as error:
        # Pillow's own text names the file object, which for bytes read from a shard is "<_io.BytesIO object at
        # 0x...>": where says where the bytes came from.
        reason = ("no image format Pillow reads" if isinstance(error, UnidentifiedImageError)
                  else " ".join(str(error).split())[:200])
        raise DataError(f"{where}: not a readable image ({reason}); replace or remove the file") from None
    width, height = image.size
    if (width, height) != (size, size):
        scale = size / min(width, height)
        resized = (max(size, round(width * scale)), max(size, round(height * scale)))
        image = image.resize(resized, Image.Resampling.BILINEAR, reducing_gap=None)
        left, top = (resized[0] - size) // 2, (resized[1] - size) // 2
        image = image.crop((left, top, left + size, top + size))
    array = np.asarray(image, dtype=np.uint8).copy()
    pixels = torch.from_numpy(array if array.ndim == 3 else array[:, :, None])
    return pixels.permute(2, 0, 1)


def load_imagefolder(root: Path, image_size: int, eval_fraction: float, seed: int
                     ) -> tuple[ImageFolderDataset, ImageFolderDataset, DatasetInfo]:
    """(train, eval, info) from a local folder in either layout."""
    if not root.is_dir():
        raise DataError(f"--data-dir {root}: no such folder; an imagefolder is a folder with one subfolder of "
                        f"images per class")
    split_folders = [root / "train", *(root / name for name in EVAL_FOLDERS)]
    eval_folder = next((folder for folder in split_folders[1:] if folder.is_dir()), None)
    if (root / "train").is_dir() and eval_folder is not None:
        classes = _classes(root / "train")
        train_files, train_labels = _scan(root / "train", classes)
        eval_files, eval_labels = _scan(eval_folder, classes)
        unknown = sorted(set(_class_folders(eval_folder)) - set(classes))
        if unknown:
            raise DataError(f"{eval_folder} has class folders that {root / 'train'} lacks: {', '.join(unknown[:5])}")
    else:
        classes = _classes(root)
        files, labels = _scan(root, classes)
        (train_files, train_labels), (eval_files, eval_labels) = _split(files, labels, eval_fraction, seed)
    if not train_files:
        raise DataError(f"--data-dir {root}: no training images; put JPEG or PNG files in the class folders")
    if not eval_files:
        raise DataError(f"--data-dir {root}: no evaluation images; raise --eval-fraction (now {eval_fraction}) or "
                        f"add a val/ folder beside train/")
    train_files, train_labels = _interleaved(train_files, train_labels, seed)
    eval_files, eval_labels = _interleaved(eval_files, eval_labels, seed + 1)
    info = DatasetInfo("imagefolder", 3, (image_size, image_size), len(classes))
    log.info("imagefolder %s: %d classes, %d training and %d evaluation images", root, len(classes),
             len(train_files), len(eval_files))
    return (ImageFolderDataset(train_files, train_labels, image_size),
            ImageFolderDataset(eval_files, eval_labels, image_size), info)


def _class_folders(folder: Path) -> list[str]:
    return sorted(entry.name for entry in folder.iterdir() if entry.is_dir() and not entry.name.startswith("."))


def _classes(folder: Path) -> list[str]:
    classes = [name for name in _class_folders(folder) if name not in ("train", *EVAL_FOLDERS)]
    if not classes:
        raise DataError(f"--data-dir {folder}: no class folders; an imagefolder holds one subfolder per class "
                        f"(DATA_DIR/cat/1.jpg, DATA_DIR/dog/2.jpg), or train/ and val/ folders that do")
    return classes


def _scan(folder: Path, classes: list[str]) -> tuple[list[Path], list[int]]:
    files, labels = [], []
    for index, name in enumerate(classes):
        class_folder = folder / name
        if not class_folder.is_dir():
            continue
        for path in sorted(class_folder.rglob("*")):
            if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file():
                files.append(path)
                labels.append(index)
    return files, labels


def _split(files: list[Path], labels: list[int], eval_fraction: float, seed: int
           ) -> tuple[tuple[list[Path], list[int]], tuple[list[Path], list[int]]]:
    """Per class, a seeded eval_fraction of the images for evaluation (at least one where a class has two)."""
    generator = torch.Generator().manual_seed(seed)
    train: tuple[list[Path], list[int]] = ([], [])
    held_out: tuple[list[Path], list[int]] = ([], [])
    for label in sorted(set(labels)):
        members = [path for path, own in zip(files, labels, strict=True) if own == label]
        order = torch.randperm(len(members), generator=generator).tolist()
        count = round(len(members) * eval_fraction)
        count = max(count, 1) if eval_fraction > 0 and len(members) > 1 else count
        for rank, position in enumerate(order):
            target = held_out if rank < count else train
            target[0].append(members[position])
            target[1].append(label)
    return train, held_out


def _interleaved(files: list[Path], labels: list[int], seed: int) -> tuple[list[Path], list[int]]:
    """A seeded order mixing the classes: the first N images (--max-train-samples N) cover every class."""
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed)).tolist()
    return [files[i] for i in order], [labels[i] for i in order]


def fetch_tree(url: str, folder: Path) -> None:
    """Copy every image under url into folder, keeping the relative paths; files of the same size are kept."""
    from trainer.data.fetch import open_url, unreachable

    fs, root = open_url(url)
    try:
        found = fs.find(root, detail=True)
    except Exception as error:  # noqa: BLE001 - an HTTP 401 is no OSError
        raise unreachable(url, error) from None
    images = {path: entry for path, entry in found.items()
              if entry.get("type") == "file" and posixpath.splitext(path)[1].lower() in IMAGE_SUFFIXES}
    if not images:
        raise DataError(f"--data-dir {url}: no image files there ({', '.join(IMAGE_SUFFIXES)})")
    copied = 0
    root = root.rstrip("/")
    for path, entry in images.items():
        local = folder / posixpath.relpath(path, root)
        if local.is_file() and entry.get("size") is not None and local.stat().st_size == entry["size"]:
            continue
        local.parent.mkdir(parents=True, exist_ok=True)
        partial = local.with_name(f".{local.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part")
        try:
            with fs.open(path, "rb") as source, partial.open("wb") as target:
                shutil.copyfileobj(source, target, COPY_CHUNK)
            os.replace(partial, local)
        except OSError as error:
            raise DataError(f"--data-dir {url}: copying {path} to {local} failed ({error})") from None
        finally:
            partial.unlink(missing_ok=True)
        copied += 1
    log.info("fetched %d of %d images from %s into %s", copied, len(images), url, folder)
