"""R², the coefficient of determination, written as a metric the trainer reduces across ranks.

Its value needs the mean of the targets, which no single rank knows; but it is a function of five
sums (of y, y², (y - ŷ)², the count, per channel), and sums are what ranks can add up exactly.
"""

from __future__ import annotations

import torch

from trainer.metrics import Metric


class R2Score(Metric):
    """1 - residual sum of squares / total sum of squares, averaged over the channels."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.add_state("target_sum", torch.zeros(channels))
        self.add_state("target_squares", torch.zeros(channels))
        self.add_state("residual_squares", torch.zeros(channels))
        self.add_state("count", 0.0)

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        targets, outputs = targets.double(), outputs.double()
        self.state["target_sum"] += targets.sum(dim=0)
        self.state["target_squares"] += targets.pow(2).sum(dim=0)
        self.state["residual_squares"] += (targets - outputs).pow(2).sum(dim=0)
        self.state["count"] += targets.shape[0]

    def compute(self) -> torch.Tensor:
        count = self.state["count"].clamp_min(1)
        total = self.state["target_squares"] - self.state["target_sum"].pow(2) / count
        return (1 - self.state["residual_squares"] / total.clamp_min(1e-12)).mean()
