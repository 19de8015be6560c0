"""A whole split held in memory as uint8 tensors, normalised one batch at a time: on the host, or where the
trainer asks for it, on the device after a uint8 copy (a quarter of float32's bytes across the bus)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset


@dataclass(frozen=True)
class DatasetInfo:
    """What the model registry needs to know about the inputs and outputs."""

    name: str
    in_channels: int
    image_size: tuple[int, int]
    num_classes: int


@dataclass(frozen=True)
class Normalise:
    """uint8 images [..., C, H, W] to float32 ``(x / 255 - mean) / std`` per channel, computed as one fused
    multiply-add ``x * scale + shift`` on whatever device the images are: the same arithmetic on the host and on
    the device, so a CPU run's numbers do not depend on where it happens. The constants are copied to a device
    once (a copy from pageable memory waits for the device, which a step must never do)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    _constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        scale, shift = self._on(images.device)
        return images.to(torch.float32) * scale + shift

    def __reduce__(self) -> tuple[type[Normalise], tuple[tuple[float, ...], tuple[float, ...]]]:
        # Without the constants made so far: a DataLoader worker started by spawn or forkserver must not receive
        # CUDA tensors (each would start a CUDA context of its own).
        return Normalise, (self.mean, self.std)

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._constants:
            std = torch.tensor(self.std, dtype=torch.float32).view(-1, 1, 1)
            mean = torch.tensor(self.mean, dtype=torch.float32).view(-1, 1, 1)
            self._constants[device] = ((1.0 / (255.0 * std)).to(device), (-mean / std).to(device))
        return self._constants[device]


class ImageTensorDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Images uint8 [N,C,H,W] and labels int64 [N], returned as normalised float32, or as uint8 with
    ``normalise_on_device`` (then ``normalise`` is the task's ``TaskData.on_device``: trainer.tasks).

    The images stay uint8 because float32 copies would be four times larger in every rank's
    memory (CIFAR-10: 600 MB instead of 150 MB); normalising a batch costs one fused multiply-add.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: Sequence[float], std: Sequence[float],
                 normalise_on_device: bool = False):
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be uint8 [N,C,H,W], got {images.dtype} {list(images.shape)}")
        if labels.dtype != torch.int64 or labels.shape != images.shape[:1]:
            raise ValueError(f"labels must be int64 [{images.shape[0]}], got {labels.dtype} {list(labels.shape)}")
        channels = images.shape[1]
        if len(mean) != channels or len(std) != channels:
            raise ValueError(f"mean and std need {channels} values (one per channel), got {len(mean)} and {len(std)}")
        self.images = images
        self.labels = labels
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.normalise = Normalise(self.mean, self.std)
        self.normalise_on_device = normalise_on_device

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._normalise(self.images[index]), self.labels[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch by tensor indexing: the DataLoader calls this instead of __getitem__ once per sample."""
        rows = torch.as_tensor(indices, dtype=torch.int64)
        return self._normalise(self.images[rows]), self.labels[rows]

    def head(self, count: int) -> ImageTensorDataset:
        """The first ``count`` samples (all of them if there are fewer)."""
        return ImageTensorDataset(self.images[:count], self.labels[:count], self.mean, self.std,
                                  self.normalise_on_device)

    def raw(self) -> ImageTensorDataset:
        """The same samples as uint8, for ``normalise`` on the device after the copy."""
        return ImageTensorDataset(self.images, self.labels, self.mean, self.std, normalise_on_device=True)

    def _normalise(self, images: torch.Tensor) -> torch.Tensor:
        return images if self.normalise_on_device else self.normalise(images)


def collate_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """DataLoader collate_fn for __getitems__ batches, which are already stacked.

    Module-level so that DataLoader workers can pickle it.
    """
    return batch
