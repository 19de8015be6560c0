"""Training from shards in a real S3-compatible server (moto, on loopback), with DataLoader workers, through a
history of 2 ranks -> 3 ranks -> SIGKILL mid-epoch -> 3 ranks again -> 1 rank: the ledger task counts every sample
of the epoch trained exactly once, and the history ends bitwise equal to the same epoch trained straight through
at one rank (--global-batch-size makes every step the same samples at any world size). At a fixed world size each
shard's samples are fetched by one rank only."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from devtools.processes import (
    REPO_ROOT,
    clean_env,
    env_ranks,
    free_port,
    kill_session,
    kill_tree,
    run,
    torchrun,
    torchrun_command,
)
from tests.integration.test_elastic import checkpoint_folders
from tests.support.ledger import decode_ledger, write_ledger_shards
from tests.support.ledger_checks import assert_each_sample_trained_once, ledger, segments
from tests.support.s3_server import S3Server
from trainer.data.shards import ShardedDataset, ShardIndex, ShardOrder, auto_lanes
from trainer.errors import EXIT_PEER_LOST, EXIT_USAGE

pytestmark = pytest.mark.slow

SIZE, GLOBAL_BATCH = 150, 12  # 12 steps of 12 samples, then one of 6
SHARD_SIZES = (7, 11, 5, 9)  # 20 shards of uneven sizes
STEPS = [GLOBAL_BATCH] * (SIZE // GLOBAL_BATCH) + [SIZE % GLOBAL_BATCH]


def ledger_args(data: str, output: Path, cache: Path, *extra: str) -> list[str]:
    return ["--task", "tests.support.ledger:ShardLedgerTask", "--shards", data, "--train-size", str(SIZE),
            "--global-batch-size", str(GLOBAL_BATCH), "--epochs", "1", "--optimizer", "sgd", "--momentum", "0",
            "--lr", "1", "--schedule", "constant", "--progress", "off", "--no-tensorboard", "--num-workers", "2",
            "--output-dir", str(output), "--shard-cache-dir", str(cache), "--job-id", "shard-ledger", *extra]


def fetched(cache: Path) -> dict[str, set[tuple[int, int]]]:
    """(shard, sample in it) of every sample each rank's training cache fetched, by folder (train-rankN)."""
    samples: dict[str, set[tuple[int, int]]] = {}
    for log in cache.glob("*/train-rank*/fetched.log"):
        for line in log.read_text().splitlines():
            _, shard, first, end, _ = line.split()
            samples.setdefault(log.parent.name, set()).update((int(shard), i) for i in range(int(first), int(end)))
    return samples


def launch(nproc: int, args: list[str], env: dict[str, str]) -> str:
    result = torchrun(args, nproc=nproc, env=env, timeout_s=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def kill_after_checkpoint(nproc: int, args: list[str], env: dict[str, str], output: Path, step: int) -> str:
    process = subprocess.Popen(torchrun_command(nproc, "trainer", args), env=clean_env(env), cwd=REPO_ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while max(checkpoint_folders(output).values(), default=0) < step:
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint at the step to kill after"
            time.sleep(0.2)
    finally:
        kill_tree(process.pid)  # the agent and its workers (torchrun starts them in sessions of their own)
        kill_session(process)
    return process.communicate()[1]


def test_a_resized_and_killed_history_trains_every_streamed_sample_once_and_ends_bitwise(s3_env: S3Server,
                                                                                         tmp_path: Path):
    data = f"s3://{s3_env.new_bucket()}/ledger"
    write_ledger_shards(data, SIZE, SHARD_SIZES)
    env = s3_env.env

    launch(1, ledger_args(data, tmp_path / "straight", tmp_path / "cache-straight"), env)
    straight = ledger(tmp_path / "straight")

    run = tmp_path / "resized"
    logs = [launch(2, ledger_args(data, run, tmp_path / "cache-2", "--max-steps", "3"), env)]
    logs.append(kill_after_checkpoint(3, ledger_args(data, run, tmp_path / "cache-3", "--checkpoint-every", "1",
                                                     "--step-delay-s", "0.3"), env, run, step=6))
    killed_at = max(checkpoint_folders(run).values())
    assert 6 <= killed_at < 12, "killed mid-epoch"
    logs.append(launch(3, ledger_args(data, run, tmp_path / "cache-3-again", "--max-steps", "9"), env))
    logs.append(launch(1, ledger_args(data, run, tmp_path / "cache-1"), env))
    assert segments(logs) == [(3, 3), (3, killed_at), (1, 9)]

    trained = ledger(run)
    assert_each_sample_trained_once(trained, STEPS)
    assert torch.equal(trained, straight), "the history ends where the straight run does, bitwise"
    assert_each_sample_trained_once(straight, STEPS)

    # At 2 ranks from the epoch's start (12 lanes, 6 each), no sample was fetched by both ranks' caches.
    by_rank = fetched(tmp_path / "cache-2")
    assert sorted(by_rank) == ["train-rank0", "train-rank1"], by_rank.keys()
    assert by_rank["train-rank0"] and not by_rank["train-rank0"] & by_rank["train-rank1"]


def test_a_sample_corrupt_mid_epoch_ends_the_run_in_one_line_naming_it(tmp_path: Path):
    """The epoch's last sample damaged on the store (same size, one byte flipped): the first batches train, the
    loader's worker meets it at the end, fetches its piece twice, and the run ends with exit 2 naming the shard
    and the sample, no traceback."""
    data = tmp_path / "data"
    write_ledger_shards(str(data), SIZE, SHARD_SIZES)
    dataset = ShardedDataset(str(data), "train", decode_ledger)
    lanes, window = auto_lanes(1), round(dataset.mean_shard_samples)
    last = ShardOrder(dataset.counts, 0, 0, lanes, window).sample(SIZE - 1)
    shard = next(index for index, start in enumerate(dataset.starts) if dataset.starts[index + 1] > last)
    span = ShardIndex.from_json((data / dataset.shards[shard].sidecar).read_bytes(), "").samples[
        last - dataset.starts[shard]]
    damaged = bytearray((data / dataset.shards[shard].name).read_bytes())
    damaged[span.members[0][1]] ^= 0xFF
    (data / dataset.shards[shard].name).write_bytes(bytes(damaged))

    result = run([sys.executable, "-m", "trainer", *ledger_args(str(data), tmp_path / "run", tmp_path / "cache")])
    assert result.returncode == EXIT_USAGE, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"{dataset.shards[shard].name}: sample {span.key}" in errors[0] and "the shard is corrupt" in errors[0]


def test_a_store_that_does_not_answer_at_start_ends_every_rank_to_be_restarted(tmp_path: Path):
    """Nothing listens at the store's address: every rank's retries run out opening the dataset, and the agreement
    between the ranks keeps the exit code that says "retry" (200), not "fix the input" (2)."""
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}
    results = env_ranks(ledger_args("s3://nowhere/ledger", tmp_path / "run", tmp_path / "cache", "--store-attempts",
                                    "2"), world_size=2, env=env, timeout_s=120)
    assert [result.returncode for result in results] == [EXIT_PEER_LOST, EXIT_PEER_LOST], results[0].stderr[-2000:]
    assert "the store kept failing" in results[0].stderr and "through 2 attempts" in results[0].stderr
