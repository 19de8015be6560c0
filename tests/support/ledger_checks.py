"""What the ledger task (tests/support/ledger.py) says about a finished run: every sample of the epoch trained
exactly once, in steps of the sizes the run's history implies, across resumes and membership changes."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from devtools.processes import torchrun
from tests.support.checkpoint_reading import newest_checkpoint


def ledger(output: Path) -> torch.Tensor:
    """How far each sample's number moved: minus the sum of its weights in the steps that trained it."""
    _, manifest, state = newest_checkpoint(output / "checkpoints")
    assert manifest["epoch"] == 1 and manifest["samples_in_epoch"] == 0, "the epoch is complete"
    return -state["model"]["weight"].flatten().double()


def assert_each_sample_trained_once(weights: torch.Tensor, step_sizes: list[int]) -> None:
    """Each step of N real samples gives each of them the weight 1/N: the mean over real samples."""
    expected = torch.tensor(sorted(1 / size for size in step_sizes for _ in range(size)), dtype=torch.float64)
    assert torch.allclose(weights.sort().values, expected, rtol=1e-5, atol=0), (weights.tolist(), step_sizes)


RESUMED = re.compile(r"\[rank 0/(\d+)\] INFO resumed from \S+step-(\d+)\S*: epoch")


def segments(logs: list[str]) -> list[tuple[int, int]]:
    """(world size, the step it resumed from) of each start of the workers after the first, in order: each
    resumes a newer checkpoint than the one before."""
    return sorted(((int(m.group(1)), int(m.group(2))) for text in logs for m in RESUMED.finditer(text)),
                  key=lambda segment: segment[1])


def trained_straight_through(args: list[str], output: Path) -> torch.Tensor:
    """The ledger of the epoch ``args`` describe, trained without interruption at one rank: what every history of
    restarts and resizes must end at, bitwise (--global-batch-size makes the steps the same at any size)."""
    result = torchrun([*args, "--output-dir", str(output)], nproc=1)
    assert result.returncode == 0, result.stderr[-3000:]
    return ledger(output)
