"""A generated dataset of any shape, the same on every rank and every run, that a model can learn.

Each class has a smooth prototype image: a background shared by all classes plus a fainter
class-specific pattern; a sample is its class's prototype plus pixel noise. A linear model needs
a few dozen steps to tell the classes apart (not one), so loss curves show learning.

Everything comes from local generators with fixed seeds, so the global RNG (which the trainer
seeds for itself) neither changes the data nor is advanced by it.

Large shapes take a while to generate (ImageNet-like 7,936 images at 3x224x224: 54 s on one core), so a
run given ``--data-cache-dir`` keeps what it generated there and the next run with the same sizes reads it.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.data.dataset import DatasetInfo, ImageTensorDataset

SEED = 20240601
PROTOTYPE_GRID = 4  # prototypes are 4x4 random grids upsampled: large blobs survive resizing and pooling
# In pixel units. With these, a linear model on 1x28x28 goes from 30% to 95% test accuracy in 30
# full-batch Adam steps; a stronger class pattern or less noise makes it trivially 100% after one.
BACKGROUND, CLASS_PATTERN, NOISE_STD = 150.0, 60.0, 48.0
CHUNK = 256  # samples generated (and their statistics summed) at a time: float scratch memory stays small
# In the cache file's name: a change to how samples are generated must not find an older cache.
CACHE_VERSION = 2
log = logging.getLogger(__name__)


def make_synthetic(shape: tuple[int, int, int], num_classes: int, train_size: int, test_size: int
                   ) -> tuple[ImageTensorDataset, ImageTensorDataset, DatasetInfo]:
    channels, height, width = shape
    prototypes = _prototypes(shape, num_classes)
    train_images, train_labels = _samples(prototypes, train_size, seed=SEED + 1)
    test_images, test_labels = _samples(prototypes, test_size, seed=SEED + 2)
    mean, std = _channel_statistics(train_images)
    info = DatasetInfo("synthetic", channels, (height, width), num_classes)
    return (ImageTensorDataset(train_images, train_labels, mean, std),
            ImageTensorDataset(test_images, test_labels, mean, std), info)


def cached_synthetic(cache_dir: Path, shape: tuple[int, int, int], num_classes: int, train_size: int,
                     test_size: int) -> tuple[ImageTensorDataset, ImageTensorDataset, DatasetInfo]:
    """make_synthetic's datasets, read from ``cache_dir`` if a run made them before, else made and kept there
    (written under a temporary name and renamed: a reader never sees half a file, and two writers race
    harmlessly to the same content)."""
    # torch's version too: its generators' streams are not promised to stay the same across releases.
    name = (f"synthetic-v{CACHE_VERSION}-torch{torch.__version__.split('+')[0]}-{'x'.join(map(str, shape))}-"
            f"{num_classes}-{train_size}-{test_size}.pt")
    path = cache_dir / name
    if path.is_file():
        cached = _read_cache(path, shape, num_classes, train_size, test_size)
        if cached is not None:
            return cached
    train, test, info = make_synthetic(shape, num_classes, train_size, test_size)
    partial = cache_dir / f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"train_images": train.images, "train_labels": train.labels, "test_images": test.images,
                    "test_labels": test.labels, "mean": list(train.mean), "std": list(train.std)}, partial)
        os.replace(partial, path)
    except OSError as error:  # a cache is a convenience: a full or read-only disk only costs the next run time
        log.warning("synthetic dataset not cached in %s (%s); it is generated again next time", cache_dir, error)
    finally:
        partial.unlink(missing_ok=True)
    return train, test, info


def _read_cache(path: Path, shape: tuple[int, int, int], num_classes: int, train_size: int, test_size: int
                ) -> tuple[ImageTensorDataset, ImageTensorDataset, DatasetInfo] | None:
    """The cached datasets, or None (with a warning naming the file) when it cannot be read or does not hold
    what its name says: the caller generates them again and replaces it."""
    try:
        saved = torch.load(path, weights_only=True)
        images, labels = saved["train_images"], saved["train_labels"]
        test_images, test_labels = saved["test_images"], saved["test_labels"]
        fits = (tuple(images.shape) == (train_size, *shape) and tuple(test_images.shape) == (test_size, *shape)
                and images.dtype == test_images.dtype == torch.uint8 and labels.shape == (train_size,)
                and test_labels.shape == (test_size,) and int(labels.max()) < num_classes)
        if not fits:
            raise ValueError("its tensors are not of the sizes its name gives")
        info = DatasetInfo("synthetic", shape[0], (shape[1], shape[2]), num_classes)
        return (ImageTensorDataset(images, labels, saved["mean"], saved["std"]),
                ImageTensorDataset(test_images, test_labels, saved["mean"], saved["std"]), info)
    except Exception as error:  # noqa: BLE001 - truncated, damaged or foreign: made again, never trusted
        log.warning("cached synthetic dataset %s is unusable (%s); generating it again",
                    path, " ".join(str(error).split())[:200])
        return None


def _channel_statistics(images: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per-channel mean and standard deviation of uint8 images scaled to [0, 1], summed in float64 a chunk at
    a time (a float32 copy of all images would be four times their size: 4.6 GB for the ImageNet-like set)."""
    count = images.shape[0] * images.shape[2] * images.shape[3]
    total = torch.zeros(images.shape[1], dtype=torch.float64)
    for start in range(0, images.shape[0], CHUNK):
        total += images[start:start + CHUNK].to(torch.float64).sum(dim=(0, 2, 3))
    mean = total / count / 255.0
    squares = torch.zeros_like(total)
    for start in range(0, images.shape[0], CHUNK):
        deviation = images[start:start + CHUNK].to(torch.float64) / 255.0 - mean.view(1, -1, 1, 1)
        squares += deviation.square().sum(dim=(0, 2, 3))
    # A constant image has std 0; the floor keeps the normalisation finite.
    std = (squares / max(1, count - 1)).sqrt().clamp_min(1e-3)
    return mean.tolist(), std.tolist()


def _prototypes(shape: tuple[int, int, int], num_classes: int) -> torch.Tensor:
    channels, height, width = shape
    generator = torch.Generator().manual_seed(SEED)
    background = torch.rand(1, channels, PROTOTYPE_GRID, PROTOTYPE_GRID, generator=generator)
    pattern = torch.rand(num_classes, channels, PROTOTYPE_GRID, PROTOTYPE_GRID, generator=generator) - 0.5
    # Pixel values 10..220 before noise: room on both sides, so that clipping rarely erases the pattern.
    grid = 40.0 + BACKGROUND * background + CLASS_PATTERN * pattern
    return F.interpolate(grid, size=(height, width), mode="bilinear", align_corners=False)


def _samples(prototypes: torch.Tensor, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    num_classes = prototypes.shape[0]
    # Balanced classes in a shuffled order, so that the first N samples (--max-*-samples) cover every class.
    labels = (torch.arange(count) % num_classes)[torch.randperm(count, generator=generator)]
    images = torch.empty((count, *prototypes.shape[1:]), dtype=torch.uint8)
    for start in range(0, count, CHUNK):
        chunk_labels = labels[start:start + CHUNK]
        noise = torch.randn((len(chunk_labels), *prototypes.shape[1:]), generator=generator) * NOISE_STD
        images[start:start + CHUNK] = (prototypes[chunk_labels] + noise).round().clamp(0, 255).to(torch.uint8)
    return images, labels
