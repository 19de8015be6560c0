"""A user's own task gets everything the built-in has: exact mid-epoch resume (random augmentation in
DataLoader workers and dropout included), resize, SyncBN, bf16, gradient accumulation, exact evaluation
with its own metrics, its metrics in JSON lines and TensorBoard, and one-line errors on every rank.

Two tasks unlike the built-in: tests/support/tasks.py (dict inputs, NumPy and torch augmentation,
torchmetrics) and the worked example examples/forecast (a GRU on generated series, its own R² metric).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devtools.processes import REPO_ROOT, env_ranks, torchrun
from tests.support.checkpoint_reading import assert_same_tensors, newest_checkpoint, summary
from tests.support.sample_logs import global_order
from trainer.errors import EXIT_USAGE
from trainer.sampler import ResumableDistributedSampler

QUIET = ["--progress", "off", "--no-tensorboard"]
# 384 sequences, 2 ranks x 16: 12 steps an epoch, 24 in all; a worker per rank fetches (and augments) items.
TOKENS = ["--task", "tests.support.tasks:TokenTask", "--epochs", "2", "--batch-size", "16", "--lr", "0.01",
          "--num-workers", "1", "--checkpoint-every", "5", *QUIET]
EXAMPLE_ENV = {"PYTHONPATH": f"{REPO_ROOT / 'examples' / 'forecast' / 'src'}:{REPO_ROOT}"}
# 8 series x (48 - 16) windows = 256 training samples, 4 x 32 = 128 for evaluation.
FORECAST = ["--task", "forecast:Forecast", "--train-series", "8", "--eval-series", "4", "--length", "48",
            "--window", "16", "--batch-size", "16", "--lr", "0.003"]


def trained(args: list[str], output: Path, nproc: int, env: dict[str, str] | None = None) -> dict:
    result = torchrun([*args, "--output-dir", str(output)], nproc=nproc, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return summary(output)


def final_state(output: Path) -> dict:
    _, manifest, state = newest_checkpoint(output / "checkpoints")
    assert manifest["step"] == 24 and manifest["task"] == "tokens"
    return {"model": state["model"], "optimizer": state["optimizer"], "position": state["position"]}


def test_a_user_task_stopped_twice_mid_epoch_ends_bitwise_like_an_uninterrupted_run(tmp_path):
    reference = trained(TOKENS, tmp_path / "reference", nproc=2)
    for stop_at in (7, 17):  # inside epoch 1, then inside epoch 2
        trained([*TOKENS, "--max-steps", str(stop_at)], tmp_path / "stopped", nproc=2)
        _, manifest, _ = newest_checkpoint(tmp_path / "stopped" / "checkpoints")
        assert manifest["step"] == stop_at and manifest["samples_in_epoch"] > 0
    resumed = trained(TOKENS, tmp_path / "stopped", nproc=2)
    assert resumed["resumed_from"].endswith("step-00000017")
    assert_same_tensors(final_state(tmp_path / "stopped"), final_state(tmp_path / "reference"))
    assert resumed["test_metrics"] == reference["test_metrics"]


def test_a_user_task_resumed_on_fewer_ranks_sees_every_sample_of_the_epoch_once_in_order(tmp_path):
    args = [*TOKENS, "--epochs", "1", "--sample-log"]
    trained([*args, "--max-steps", "5"], tmp_path, nproc=2)
    result = trained(args, tmp_path, nproc=1)
    assert result["resumed_from"].endswith("step-00000005") and result["world_size"] == 1
    first, second = global_order(tmp_path, 2, 0, 5), global_order(tmp_path, 1, 5, 10**9)
    assert first + second == ResumableDistributedSampler(range(384), 1, 0, seed=0).epoch_order()


def test_the_example_trains_with_syncbn_bf16_and_accumulation_and_reports_its_own_metrics(tmp_path):
    args = [*FORECAST, "--epochs", "2", "--sync-bn", "--precision", "bf16", "--grad-accum-steps", "2",
            "--log-every", "2", "--progress", "off", "--tensorboard", "--output-dir", str(tmp_path)]
    result = torchrun(args, nproc=2, env=EXAMPLE_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--sync-bn: 1 BatchNorm layer(s) of the model synchronised across 2 ranks" in result.stderr
    final = summary(tmp_path)
    assert final["task"] == "forecast" and final["global_step"] == 2 * 256 // (16 * 2 * 2)
    assert set(final["test_metrics"]) == {"loss", "mae", "r2", "samples"} and final["test_samples"] == 128
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "mae", "r2", "lr", "samples_per_s"} <= set(next(r for r in records if r["kind"] == "train"))
    assert {"loss", "mae", "r2", "samples"} <= set(next(r for r in records if r["kind"] == "test"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"train/mae", "train/r2", "test/mae", "test/r2", "test/loss"} <= set(events.Tags()["scalars"])


@pytest.mark.parametrize(("task", "env"), [
    ([*FORECAST, "--epochs", "1"], EXAMPLE_ENV),
    ([*TOKENS, "--epochs", "1", "--eval-size", "97"], None),
], ids=["example-r2-mae", "torchmetrics-f1"])
def test_evaluation_with_a_user_tasks_metrics_is_the_same_on_any_number_of_ranks(task, env, tmp_path):
    reference = trained([*task, *QUIET], tmp_path / "w1", nproc=1, env=env)
    checkpoint = tmp_path / "w1" / "checkpoints" / newest_checkpoint(tmp_path / "w1" / "checkpoints")[0]
    evaluated = trained([*task, *QUIET, "--resume", str(checkpoint)], tmp_path / "w3", nproc=3, env=env)
    assert evaluated["world_size"] == 3 and evaluated["test_samples"] == reference["test_samples"]
    for name, value in reference["test_metrics"].items():
        assert evaluated["test_metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_a_bad_item_in_one_ranks_first_batch_stops_every_rank_with_the_same_line(tmp_path):
    # 32 items, 2 ranks x 16: the first batches hold every item, so exactly one rank meets item 5 there.
    args = ["--task", "tests.support.broken_tasks:ItemOfTheWrongShape", "--batch-size", "16", *QUIET,
            "--output-dir", str(tmp_path)]
    results = env_ranks(args, world_size=2, timeout_s=120)
    lines = []
    for rank, result in enumerate(results):
        assert result.returncode == EXIT_USAGE and "Traceback" not in result.stderr, result.stderr[-3000:]
        [line] = [line for line in result.stderr.splitlines() if "error:" in line]
        lines.append(line.removeprefix(f"[rank {rank}] "))
    assert lines[0] == lines[1] and "seen by rank" in lines[0]
    assert "item 5 has (a float32 tensor of shape [3]" in lines[0]
    assert not list((tmp_path / "checkpoints").glob("step-*"))
