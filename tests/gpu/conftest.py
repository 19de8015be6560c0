"""The GPU suite: ``make gpu-check`` (``pytest -m gpu tests/gpu``) on any machine with a CUDA device.

``make test`` leaves it out by marker (pyproject's ``-m "not gpu"``), so it never shows as skipped on CPU
machines; selected without a GPU, it fails at once with the reason rather than skipping. A test this machine
cannot run (two GPUs needed on one) calls ``not_run``: it is listed at the end under "NOT RUN on this
machine", with its reason, and never counted as passed.
"""

from __future__ import annotations

import os
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


NOT_RUN = "NOT RUN on this machine: "


def not_run(reason: str) -> None:
    """Under CI=true a test that cannot run fails instead (as tests/support/preconditions.py does): CI never
    selects this suite, and one that does must provide what it needs."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{NOT_RUN}{reason} (CI=true: a test that cannot run fails)")
    pytest.skip(f"{NOT_RUN}{reason}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    skipped = [report for report in terminalreporter.stats.get("skipped", []) if NOT_RUN in str(report.longrepr)]
    if skipped:
        terminalreporter.section("NOT RUN on this machine (not passed: run them where they can run)")
        for report in skipped:
            reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
            terminalreporter.line(f"{report.nodeid}: {reason.split(NOT_RUN, 1)[-1]}")
