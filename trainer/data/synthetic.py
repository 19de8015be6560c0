"""A generated dataset of any shape, the same on every rank and every run, that a model can learn.

Each class has a smooth prototype image: a background shared by all classes plus a fainter
class-specific pattern; a sample is its class's prototype plus pixel noise. A linear model needs
a few dozen steps to tell the classes apart (not one), so loss curves show learning.

Everything comes from local generators with fixed seeds, so the global RNG (which the trainer
seeds for itself) neither changes the data nor is advanced by it.

Large shapes take a while to generate (ImageNet-like 7,936 images at 3x224x224: about 35 s on one core), so a
run given ``--data-cache-dir`` keeps what it generated there and the next run with the same sizes reads it.
"""

from __future__ import annotations

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
    name = f"synthetic-v{CACHE_VERSION}-{'x'.join(map(str, shape))}-{num_classes}-{train_size}-{test_size}.pt"
    path = cache_dir / name
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        info = DatasetInfo("synthetic", shape[0], (shape[1], shape[2]), num_classes)
        mean, std = saved["mean"], saved["std"]
        return (ImageTensorDataset(saved["train_images"], saved["train_labels"], mean, std),
                ImageTensorDataset(saved["test_images"], saved["test_labels"], mean, std), info)
    train, test, info = make_synthetic(shape, num_classes, train_size, test_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = cache_dir / f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part"
    try:
        torch.save({"train_images": train.images, "train_labels": train.labels, "test_images": test.images,
                    "test_labels": test.labels, "mean": list(train.mean), "std": list(train.std)}, partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return train, test, info


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
