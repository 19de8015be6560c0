"""The GPU suite: ``make gpu-check`` (``pytest -m gpu tests/gpu``) on any machine with a CUDA device.

``make test`` leaves it out by marker (pyproject's ``-m "not gpu"``), so it never shows as skipped on CPU
machines; selected without a GPU, it fails at once with the reason rather than skipping.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True)
def cuda_device() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the GPU suite needs a CUDA device and torch built with CUDA; `make test` is the CPU suite")
