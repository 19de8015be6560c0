"""Learning rate as a function of the samples consumed, not of the step count: a job resumed with a
different number of ranks takes different steps but passes through the same schedule."""

from __future__ import annotations

import math
from typing import Any

from torch.optim import Optimizer

SCHEDULES = ("constant", "cosine")


class LRSchedule:
    """Linear warm-up, then constant or cosine decay to zero at the end of training."""

    def __init__(self, kind: str, base_lr: float, warmup_samples: int, total_samples: int) -> None:
        self.kind = kind
        self.base_lr = base_lr
        self.warmup_samples = warmup_samples
        self.total_samples = max(1, total_samples)

    def lr_at(self, samples_seen: int) -> float:
        if samples_seen < self.warmup_samples:
            return self.base_lr * (samples_seen + 1) / (self.warmup_samples + 1)
        if self.kind == "constant":
            return self.base_lr
        span = max(1, self.total_samples - self.warmup_samples)
        progress = min(1.0, (samples_seen - self.warmup_samples) / span)
        return self.base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer: Optimizer, samples_seen: int) -> float:
        lr = self.lr_at(samples_seen)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "base_lr": self.base_lr, "warmup_samples": self.warmup_samples,
                "total_samples": self.total_samples}
