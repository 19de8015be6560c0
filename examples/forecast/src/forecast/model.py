"""The forecaster: a convolution over time with BatchNorm, a GRU, dropout, and a linear head."""

from __future__ import annotations

import torch
from torch import nn


class ForecastNet(nn.Module):
    def __init__(self, channels: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Conv1d(channels, hidden, kernel_size=3, padding=1)
        self.norm = nn.BatchNorm1d(hidden)  # what --sync-bn synchronises across ranks
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, channels)

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        """[batch, steps, channels] -> the next step, [batch, channels]."""
        features = torch.relu(self.norm(self.embed(window.transpose(1, 2)))).transpose(1, 2)
        states, _ = self.gru(features)
        return self.head(self.dropout(states[:, -1]))
