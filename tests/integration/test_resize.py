"""Resuming with another world size continues the same epoch order at the same global position:
across the two segments, every sample of the epoch is seen exactly once, in the epoch's order."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from devtools.processes import run, torchrun
from tests.support.checkpoint_reading import summary
from tests.support.ledger_checks import assert_each_sample_trained_once, ledger
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


def learning_rates(output: Path) -> dict[int, float]:
    """The learning rate of each logged step, by the number of samples seen (metrics.jsonl)."""
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return {record["samples_seen"]: record["lr"] for record in records if record["kind"] == "train"}


def test_after_a_resize_the_learning_rate_is_the_uninterrupted_runs_at_the_same_number_of_samples(tmp_path):
    """The schedule is a function of samples seen: 2 ranks for 6 steps then 1 rank takes twice the steps of
    the uninterrupted 2-rank run for the rest of the epoch, and passes through the same learning rates."""
    # No warm-up: --warmup-steps becomes samples with the world size of the run that starts, so a resize moves it.
    every_step = ["--log-every", "1"]
    launch(2, tmp_path / "uninterrupted", *every_step)
    launch(2, tmp_path / "resized", *every_step, "--max-steps", str(STOP_AT))
    launch(1, tmp_path / "resized", *every_step)
    reference, resized = learning_rates(tmp_path / "uninterrupted"), learning_rates(tmp_path / "resized")
    after_the_resize = sorted(samples for samples in reference.keys() & resized.keys()
                              if samples > STOP_AT * BATCH * 2)
    assert len(after_the_resize) == (SIZE - STOP_AT * BATCH * 2) // (BATCH * 2)  # every step of the 2-rank run
    assert len({reference[samples] for samples in after_the_resize}) > 1, "the rate changes along the way"
    assert [resized[samples] for samples in after_the_resize] == [reference[samples] for samples in after_the_resize]


# The ledger task (tests/support/ledger.py): 98 samples, never divided evenly by 3 ranks x 4; with 3 ranks the epoch's
# last global batch holds 2 samples, so rank 2 has nothing in it (a placeholder step of weight zero).
LEDGER = ["--task", "tests.support.ledger:LedgerTask", "--batch-size", "4", "--epochs", "1", "--optimizer", "sgd",
          "--momentum", "0", "--lr", "1", "--schedule", "constant", "--progress", "off", "--no-tensorboard",
          "--sample-log"]


def test_every_sample_is_trained_exactly_once_at_world_sizes_that_do_not_divide_the_epoch(tmp_path):
    """3 ranks x 4: 8 steps of 12 samples, then one of 2 (ranks 0 and 1 train one sample each, rank 2 none)."""
    result = torchrun([*LEDGER, "--output-dir", str(tmp_path)], nproc=3)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_each_sample_trained_once(ledger(tmp_path), [12] * 8 + [2])
    trained = global_order(tmp_path, 3, 0, 10**9)
    assert trained == ResumableDistributedSampler(range(98), 1, 0, seed=0).epoch_order()  # the log: trained only


def test_every_sample_is_trained_once_across_a_resize_with_gradient_accumulation(tmp_path):
    """3 ranks, 2 micro-batches a step (24 samples), stopped after 2 steps; resumed with 2 ranks (16 a step):
    50 samples left, 3 full steps and a last one of 2 samples in one micro-batch (one per rank)."""
    accumulate = [*LEDGER, "--grad-accum-steps", "2", "--output-dir", str(tmp_path)]
    first = torchrun([*accumulate, "--max-steps", "2"], nproc=3)
    assert first.returncode == 0, first.stderr[-3000:]
    second = torchrun(accumulate, nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    assert summary(tmp_path)["resumed_from"].endswith("step-00000002")
    assert_each_sample_trained_once(ledger(tmp_path), [24] * 2 + [16] * 3 + [2])
