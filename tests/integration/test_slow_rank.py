"""The slow rank named, on two real ranks under torchrun (gloo): rank 1 even with rank 0 for 150 steps, then its
forward pass doing twice the work for 50, then its batches taking twice as long to load for 50
(tests/support/slow_tasks.py). While rank 1 loads slowly, rank 0 waits for it in DDP's broadcast of the ConvNet's
BatchNorm buffers, before its forward: that must not make rank 0 look slow in compute."""

from __future__ import annotations

import json
import re

import pytest

from devtools.processes import torchrun

# Timing-sensitive (step times compared across ranks): never run beside other tests (tests/conftest.py).
pytestmark = pytest.mark.serial

EVEN, SLOWED = 150, 50
RUN = ["--task", "tests.support.slow_tasks:SlowRankTask", "--dataset", "synthetic", "--synthetic-shape", "1,16,16",
       "--synthetic-train-size", str(2 * 8 * (EVEN + 2 * SLOWED)), "--synthetic-test-size", "16", "--batch-size", "8",
       "--epochs", "1", "--phases", f"none:{EVEN},compute:{SLOWED},data:{SLOWED}", "--slow-by", "1",
       "--load-ms", "20", "--forward-ms", "20", "--slow-rank-every", "5", "--progress", "off", "--no-tensorboard",
       "--log-every", "100"]
WITHIN = 50  # steps from the slowdown's start to the verdict (3 windows of 5 steps, read one step later, and slack)


def test_a_rank_slowed_in_compute_then_in_data_is_named_for_each_within_50_steps_and_no_one_while_even(tmp_path):
    result = torchrun([*RUN, "--output-dir", str(tmp_path)], nproc=2, timeout_s=240)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    named = [r for r in records if r["kind"] == "slow_rank"]
    events = {(r["rank"], "data" if "data_ratio" in r else "compute", r["slow"]): r["step"] for r in named}
    assert len(named) == len(events) == 3, named  # rank 1 once for each, rank 0 never: no event before EVEN
    assert EVEN < events[1, "compute", 1] <= EVEN + WITHIN + 1, events
    assert EVEN + SLOWED < events[1, "data", 1] <= EVEN + SLOWED + WITHIN + 1, events
    assert EVEN + SLOWED < events[1, "compute", 0] <= EVEN + SLOWED + WITHIN + 1, events
    lines = [line for line in result.stderr.splitlines() if "slow in " in line]
    assert len(lines) == 3 and all("[rank 0/2]" in line for line in lines), lines  # rank 0 says it, once
    assert re.search(r"\[rank 0/2\] WARNING rank 1 \(\S+, local rank 1\) is slow in compute \(its forward pass and "
                     r"loss\): \d\.\d\dx the other ranks' median over the last 15 steps \(\d+\.\d ms a step against "
                     r"\d+\.\d ms\); it costs every rank about \d+\.\d ms a step \(\d+% of a step\)", result.stderr)
    assert re.search(r"WARNING rank 1 \(\S+, local rank 1\) is slow in data \(waiting for its batches: loading, and "
                     r"the copy to the device\): \d\.\d\dx ", result.stderr)
    assert re.search(r"INFO rank 1 \(\S+, local rank 1\) is no longer slow in compute: \d\.\d\dx ", result.stderr)
