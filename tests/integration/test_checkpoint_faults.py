"""Storage faults injected into a real S3-compatible server on loopback (moto behind tests/support/s3_faults.py),
during periodic saves, the final save and a resume, with two real ranks: periodic saves that fail are warnings on
every rank and training goes on, a stall holds a save until the store answers, the final save is tried again until
it commits, a lease the store does not return for longer than its expiry is neither lost nor taken, a resume whose
store fails ends with exit 200 and never starts afresh; nothing is lost, and the final weights equal, bitwise,
those of the same run without faults."""

from __future__ import annotations

import errno
import re
import time
import uuid

from devtools.processes import env_ranks
from devtools.s3_faults import matching
from tests.support.checkpoint_reading import assert_same_tensors, whole
from trainer.api import run
from trainer.checkpoint import open_storage, verify
from trainer.checkpoint.storage import FsspecStorage, step_of
from trainer.errors import EXIT_PEER_LOST, EXIT_USAGE

# 2 ranks x 8 samples a step: 6 steps; a save at every step, the lease renewed every second.
ARGS = ["--dataset", "synthetic", "--synthetic-train-size", "96", "--synthetic-test-size", "16", "--batch-size", "8",
        "--epochs", "1", "--progress", "off", "--no-tensorboard", "--checkpoint-every", "1", "--lease-expiry-s", "4",
        "--keep-last", "10", "--job-id", "faults-test"]
STEPS = 6


def train(location: str, output: str, env: dict[str, str], *more: str) -> list:
    return env_ranks([*ARGS, "--checkpoint-dir", location, "--output-dir", output, *more], world_size=2, env=env,
                     timeout_s=240)


def final_model(location: str) -> dict:
    storage = open_storage(location)
    (newest, *_) = storage.list_checkpoints()
    assert step_of(newest) == STEPS, storage.list_checkpoints()
    return whole(verify(storage, newest))["model"]


def test_saves_and_a_resume_through_a_failing_store_lose_nothing_and_train_as_without_faults(s3_env, s3_faults,
                                                                                          tmp_path):
    env = s3_faults.env
    reference = f"s3://{s3_env.new_bucket()}/ckpt"
    ranks = train(reference, str(tmp_path / "reference"), env)
    assert [rank.returncode for rank in ranks] == [0, 0], ranks[0].stderr[-3000:]

    location = f"s3://{s3_env.new_bucket()}/ckpt"
    bucket = location.removeprefix("s3://").split("/")[0]
    under = f"/{bucket}/ckpt/"
    # Steps 2 and 3: every request of the save is throttled, then answered with 500s (two failed saves in a row,
    # under --max-failed-saves 3); step 4: its uploads stall for 3 s (the save waits, then commits); step 6 (the
    # last, saved once: its final save): every request is reset for 12 s, and the save is tried again until the
    # store answers; and the lease's file is refused for 6 s (longer than its 4 s expiry) once taken.
    s3_faults.fail("slowdown", 600, matching(under=under, contains="/step-00000002."))
    s3_faults.fail("error500", 600, matching(under=under, contains="/step-00000003."))
    # A fault with ``after`` starts at the request after that many: when training gets there.
    s3_faults.fail("stall", 3, matching(methods=["PUT"], under=under, contains="/step-00000004."), after=1)
    s3_faults.fail("reset", 12, matching(under=under, contains="/step-00000006."), after=1)
    s3_faults.fail("slowdown", 6, matching(under=under, contains="/.lease/"), after=1)
    started = time.monotonic()
    ranks = train(location, str(tmp_path / "faults"), env)
    took = time.monotonic() - started
    logs = [rank.stderr for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], logs[0][-5000:]
    print(f"the run through the faults took {took:.0f}s; requests failed: "
          f"{ {kind: s3_faults.failed(kind) for kind in ('slowdown', 'error500', 'reset', 'stall')} }")
    for rank, log in enumerate(logs):
        assert "Traceback" not in log, log[-5000:]
        skipped = re.findall(r"checkpoint at step (\d+) not saved \((\d) of --max-failed-saves 3 in a row\)", log)
        assert [step for step, _ in skipped][:2] == ["2", "3"] and [count for _, count in skipped][:2] == ["1", "2"], (
            rank, skipped, log[-5000:])
        assert "Please reduce your request rate" in log and "We encountered an internal error" in log, rank
        assert re.search(r"the final checkpoint at step 6 was not saved: .*; trying again in 1s", log), log[-5000:]
    assert "taken over" not in "".join(logs) and "could not renew the lease" in logs[0]
    assert s3_faults.failed("stall") >= 1 and s3_faults.failed("reset") >= 1
    storage = open_storage(location)
    saved = sorted(step_of(name) or 0 for name in storage.list_checkpoints())
    assert saved[0] == 1 and {4, 5, 6} <= set(saved) and not {2, 3} & set(saved), saved
    assert_same_tensors(final_model(location), final_model(reference))

    # A resume whose store throttles every read of a checkpoint: exit 200 on every rank, in one line; nothing
    # starts afresh, nothing is skipped for an older checkpoint.
    s3_faults.fail("slowdown", 600, matching(methods=["GET"], under=under, contains="/step-"))
    resumed = train(location, str(tmp_path / "resume-refused"), env)
    for rank in resumed:
        assert rank.returncode == EXIT_PEER_LOST, rank.stderr[-3000:]
        assert "Traceback" not in rank.stderr
        [line] = [line for line in rank.stderr.splitlines() if "error:" in line]
        assert "manifest.json unreadable (Please reduce your request rate" in line and line.endswith(
            f"exiting with {EXIT_PEER_LOST} so the launcher restarts the job from its last checkpoint"), line
    s3_faults.clear()
    again = train(location, str(tmp_path / "resume"), env)
    assert [rank.returncode for rank in again] == [0, 0], again[0].stderr[-3000:]
    assert "all 1 epochs are done" in again[0].stderr, again[0].stderr[-3000:]
    assert_same_tensors(final_model(location), final_model(reference))


def test_a_sharded_resume_whose_reads_the_store_throttles_ends_to_be_retried_and_one_it_refuses_to_be_fixed(
        tmp_path, monkeypatch, capfd):
    """DCP's own reads (each rank's .distcp ranges, through trainer.checkpoint.dcp_reader): throttled, the resume
    stops with exit 200 (never "use an older checkpoint or --resume none", which would throw progress away);
    refused for good (no permission), exit 2. One process, --sync fsdp, in this process."""
    location = f"memory://faults-{uuid.uuid4().hex[:8]}/ckpt"
    args = ["--dataset", "synthetic", "--synthetic-train-size", "32", "--synthetic-test-size", "8", "--batch-size",
            "8", "--epochs", "1", "--progress", "off", "--no-tensorboard", "--checkpoint-dir", location, "--sync",
            "fsdp", "--job-id", "sharded-faults"]
    assert run(argv=[*args, "--output-dir", str(tmp_path / "first"), "--max-steps", "2"]) == 0
    read_range = FsspecStorage.read_range
    for error, code in ((OSError(errno.EBUSY, "Please reduce your request rate."), EXIT_PEER_LOST),
                        (PermissionError(errno.EACCES, "Permission denied"), EXIT_USAGE)):
        def failing(self, name, filename, *rest, error=error):  # noqa: ANN001, ANN202 - the backend's signature
            if filename.endswith(".distcp"):
                raise error
            return read_range(self, name, filename, *rest)

        monkeypatch.setattr(FsspecStorage, "read_range", failing)
        capfd.readouterr()
        assert run(argv=[*args, "--output-dir", str(tmp_path / "resume"), "--max-steps", "4"]) == code
        [line] = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
        assert f"__0_0.distcp unreadable ({error.strerror})" in line, line
        assert ("--resume none" in line) is (code == EXIT_USAGE), line
    monkeypatch.undo()
    assert run(argv=[*args, "--output-dir", str(tmp_path / "resume"), "--max-steps", "4"]) == 0


def test_a_job_whose_attempts_keep_failing_without_a_checkpoint_stops_being_retried(tmp_path, monkeypatch, capfd):
    """Every save fails (a store that refuses writes with 503s for good): each attempt ends with exit 200, which
    launchers retry, and none commits a checkpoint; after --max-attempts-without-progress of them the next attempt
    is refused with exit 2 and says why, so the retries end. Started once more with no limit, on a store that
    answers again, it trains."""
    location = f"memory://faults-{uuid.uuid4().hex[:8]}/ckpt"
    args = ["--dataset", "synthetic", "--synthetic-train-size", "32", "--synthetic-test-size", "8", "--batch-size",
            "8", "--epochs", "1", "--progress", "off", "--no-tensorboard", "--checkpoint-dir", location,
            "--checkpoint-every", "1", "--max-failed-saves", "1", "--job-id", "no-progress",
            "--output-dir", str(tmp_path)]
    write_file = FsspecStorage.write_file

    def refused(self, temporary, filename, write_content):  # noqa: ANN001, ANN202 - the backend's signature
        if filename == "state.pt":
            raise OSError(errno.EBUSY, "Please reduce your request rate.")
        return write_file(self, temporary, filename, write_content)

    monkeypatch.setattr(FsspecStorage, "write_file", refused)
    codes = [run(argv=[*args, "--max-attempts-without-progress", "2"]) for _ in range(3)]
    assert codes == [EXIT_PEER_LOST, EXIT_PEER_LOST, EXIT_USAGE], codes
    [line] = [line for line in capfd.readouterr().err.splitlines()[-5:] if "error:" in line]
    assert ("the last 2 attempts of this job (no-progress) ended without committing a checkpoint past step 0 (the "
            "last: exit 200: 1 checkpoint save(s) in a row failed (--max-failed-saves 1), the last at step 1: could "
            "not write checkpoint") in line, line
    assert line.endswith("it is not retried again (--max-attempts-without-progress 2). Fix the cause, then start it "
                         "once more with --max-attempts-without-progress 0"), line
    monkeypatch.undo()
    assert run(argv=[*args, "--max-attempts-without-progress", "0"]) == 0
    assert run(argv=[*args, "--max-attempts-without-progress", "2", "--epochs", "2"]) == 0  # the count began again
