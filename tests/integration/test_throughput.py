"""The FLOPs count (trainer/throughput.py) on real ranks: rank 0 counts alone, so no rank waits on another's."""

from __future__ import annotations

from devtools.processes import torchrun


def test_a_count_that_would_fail_on_rank_one_under_sync_bn_neither_hangs_nor_fails_the_run(tmp_path):
    """tests.support.tasks:CountFailsOnRankOneTask: its layer refuses the counter on rank 1. Had each rank counted,
    rank 0 would wait in the synchronised BatchNorm's all-reduce while rank 1, its count given up, waited in DDP's
    broadcast: a hang until --collective-timeout-s, then exit 200. Only rank 0 counts, on a copy of the model whose
    BatchNorm is local."""
    result = torchrun(["--task", "tests.support.tasks:CountFailsOnRankOneTask", "--sync-bn", "--batch-size", "4",
                       "--max-steps", "2", "--epochs", "1", "--progress", "off", "--no-tensorboard",
                       "--collective-timeout-s", "10", "--output-dir", str(tmp_path)], nproc=2, timeout_s=120)
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if " INFO throughput: " in line]
    # The first Linear (64 -> 8) forward and its weight's gradient, the last (8 -> 2) three times: 2,144 FLOPs.
    assert "[rank 0/2] INFO throughput: 2.14 kFLOP per sample (forward and backward, counted by " in line, line
