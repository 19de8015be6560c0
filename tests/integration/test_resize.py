"""Resuming with another world size continues the same epoch order at the same global position:
across the two segments, every sample of the epoch is seen exactly once, in the epoch's order."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.checkpoints import summary
from tests.support.procs import run, torchrun
from tests.support.sample_logs import global_order
from trainer.sampler import ResumableDistributedSampler

SIZE, BATCH, STOP_AT = 240, 8, 6  # 240 divides evenly for 1, 2 and 3 ranks: no padding to discount
ARGS = ["--dataset", "synthetic", "--synthetic-train-size", str(SIZE), "--synthetic-test-size", "32", "--batch-size",
        str(BATCH), "--epochs", "1", "--seed", "7", "--progress", "off", "--no-tensorboard", "--sample-log"]


def launch(nproc: int, output: Path, *extra: str) -> None:
    args = [*ARGS, "--output-dir", str(output), *extra]
    result = torchrun(args, nproc=nproc) if nproc > 1 else run([sys.executable, "-m", "trainer", *args])
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3)])
def test_resume_after_a_change_of_world_size_sees_every_sample_once_in_order(tmp_path, before, after):
    launch(before, tmp_path, "--max-steps", str(STOP_AT))
    launch(after, tmp_path)
    assert summary(tmp_path)["resumed_from"].endswith(f"step-{STOP_AT:08d}")
    first = global_order(tmp_path, before, 0, STOP_AT)
    second = global_order(tmp_path, after, STOP_AT, 10**9)
    assert len(first) == STOP_AT * BATCH * before
    epoch_order = ResumableDistributedSampler(range(SIZE), 1, 0, seed=7).epoch_order()
    assert first + second == epoch_order
