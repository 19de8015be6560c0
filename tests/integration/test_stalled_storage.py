"""A checkpoint write that hangs (the storage stops answering: a hung NFS mount, a bucket behind a dead proxy)
ends the job on every rank within --checkpoint-timeout-s, with one line and the retryable exit 200; the next
attempt resumes from the last complete checkpoint. The storage is a real S3-compatible server on loopback,
frozen with SIGSTOP in the middle of training."""

from __future__ import annotations

import threading
import time

import pytest
import s3fs

from devtools.processes import env_ranks
from trainer.checkpoint import open_storage, verify
from trainer.checkpoint.manager import InvalidCheckpoint, UnknownFormat
from trainer.checkpoint.storage import step_of
from trainer.errors import EXIT_PEER_LOST

# Timing-sensitive (a storage timeout of 4 s): never run beside other tests (tests/conftest.py).
pytestmark = pytest.mark.serial

TIMEOUT_S = 4
# A run that goes on for minutes unless stopped: a checkpoint at every step. --job-id: the ranks are started by
# hand on loopback, which names no job, and the restart must be the same job to take its own lease at once.
ARGS = ["--dataset", "synthetic", "--synthetic-train-size", "64", "--synthetic-test-size", "16", "--batch-size", "8",
        "--progress", "off", "--no-tensorboard", "--checkpoint-every", "1", "--job-id", "stall-test",
        "--checkpoint-timeout-s", str(TIMEOUT_S)]


def committed(filesystem: s3fs.S3FileSystem, location: str) -> list[str]:
    filesystem.invalidate_cache()
    return sorted(path.rsplit("/", 2)[-2] for path in filesystem.glob(f"{location.removeprefix('s3://')}/step-*/"
                                                                       f"manifest.json"))


def test_a_write_to_storage_that_stops_answering_ends_every_rank_retryably_and_the_retry_resumes(s3_env, tmp_path):
    location = f"s3://{s3_env.new_bucket()}/ckpt"
    filesystem = s3fs.S3FileSystem(skip_instance_cache=True)
    outcome: dict[str, object] = {}

    def job() -> None:  # the ranks, run to their end in this thread; anything it raises fails the test below
        try:
            outcome["ranks"] = env_ranks([*ARGS, "--epochs", "10000", "--checkpoint-dir", location, "--output-dir",
                                          str(tmp_path / "first")], world_size=2, env=s3_env.env, timeout_s=240)
        except BaseException as error:  # noqa: BLE001 - reported by the assertion on outcome
            outcome["error"] = error

    runner = threading.Thread(target=job, daemon=True)
    runner.start()
    deadline = time.monotonic() + 180
    while len(committed(filesystem, location)) < 2:
        assert runner.is_alive(), f"the job ended before its second checkpoint: {outcome}"
        assert time.monotonic() < deadline, "no two checkpoints within 180s"
        time.sleep(0.2)
    with s3_env.stopped():
        frozen_at = time.monotonic()
        runner.join(timeout=120)
        took = time.monotonic() - frozen_at
    assert not runner.is_alive(), "the job went on waiting for the frozen storage"
    assert "error" not in outcome, outcome.get("error")
    ranks = outcome["ranks"]
    assert took < TIMEOUT_S + 60, f"the job took {took:.0f}s to stop"
    for rank, result in enumerate(ranks):
        assert result.returncode == EXIT_PEER_LOST, (rank, result.returncode, result.stderr[-3000:])
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        [line] = [line for line in result.stderr.splitlines() if "error:" in line]
        assert f"{location}/step-" in line and f"was not written within {TIMEOUT_S}s (--checkpoint-timeout-s)" in line
        assert line.endswith(f"exiting with {EXIT_PEER_LOST} so the launcher restarts the job from its last "
                             f"checkpoint"), line
    # The retry: the newest complete checkpoint is intact, and it is where the next attempt starts.
    storage = open_storage(location)
    newest = next(name for name in storage.list_checkpoints() if _valid(storage, name))
    step = step_of(newest)
    state_file = f"{location.removeprefix('s3://')}/{newest}/state.pt"
    downloads_before = s3_env.gets(state_file)
    retry = env_ranks([*ARGS, "--epochs", "10000", "--max-steps", str(step + 1), "--checkpoint-dir", location,
                       "--output-dir", str(tmp_path / "retry")], world_size=2, env=s3_env.env, timeout_s=240)
    assert [result.returncode for result in retry] == [0, 0], retry[0].stderr[-3000:]
    assert f"resumed from {location}/{newest}" in retry[0].stderr, retry[0].stderr[-3000:]
    # Rank 0 downloads the state file to check it; then the node's two ranks map one copy, downloaded once.
    assert s3_env.gets(state_file) - downloads_before == 2


def _valid(storage, name: str) -> bool:  # noqa: ANN001 - a CheckpointStorage
    try:
        verify(storage, name)
        return True
    except (InvalidCheckpoint, UnknownFormat):
        return False
