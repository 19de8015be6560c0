"""Comparing tensors at the precision they were computed in."""

from __future__ import annotations

import torch
from torch import Tensor


def close(actual: Tensor, expected: Tensor, dtype: torch.dtype = torch.float32) -> None:
    # bf16 keeps 8 significant bits: one rounding step apart is ~1% of the value.
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(actual, expected, **tolerance)
