"""Generated sensor series: each channel a sum of slow waves plus a drift, sampled in windows.

A sample is ``window`` steps of every channel (the inputs, [window, channels]) and the step that
follows (the target, [channels]). The series come from a seeded generator and live in memory; the
training items get measurement noise drawn anew each time they are fetched, which is random
augmentation: the trainer seeds each item, so a resumed or resized run sees the same noise.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset


def make_series(count: int, length: int, channels: int, seed: int) -> torch.Tensor:
    """[count, length, channels] float32: waves of random periods and phases, a drift, unit-ish scale."""
    generator = torch.Generator().manual_seed(seed)
    steps = torch.arange(length, dtype=torch.float64).view(1, length, 1)
    series = torch.zeros(count, length, channels, dtype=torch.float64)
    for _ in range(3):
        period = 8 + 56 * torch.rand(count, 1, channels, generator=generator, dtype=torch.float64)
        phase = 2 * math.pi * torch.rand(count, 1, channels, generator=generator, dtype=torch.float64)
        amplitude = 0.3 + torch.rand(count, 1, channels, generator=generator, dtype=torch.float64)
        series += amplitude * torch.sin(2 * math.pi * steps / period + phase)
    drift = 0.01 * torch.randn(count, 1, channels, generator=generator, dtype=torch.float64)
    return (series + drift * steps).to(torch.float32)


class SensorWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every window of ``window`` steps of every series, and the step after it."""

    def __init__(self, series: torch.Tensor, window: int, noise: float) -> None:
        self.series = series
        self.window = window
        self.noise = noise
        self.per_series = series.shape[1] - window

    def __len__(self) -> int:
        return self.series.shape[0] * self.per_series

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        which, start = divmod(index, self.per_series)
        inputs = self.series[which, start:start + self.window]
        target = self.series[which, start + self.window]
        if self.noise:
            inputs = inputs + self.noise * torch.randn_like(inputs)
        return inputs, target
