"""The checkpoint folder's lease: one job at a time, the same job's restart and an expired or released lease
let in at once, a race won by exactly one job, on local disks and through fsspec."""

from __future__ import annotations

import logging
import threading
import tomllib
from importlib.metadata import version as fsspec_version
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from tests.support.checkpoint_reading import state_at
from trainer.checkpoint import CheckpointManager, Monitor, open_storage, storage
from trainer.checkpoint.lease import LEASE_FOLDER, CheckpointLease, Holder
from trainer.checkpoint.storage import step_of
from trainer.config import CheckpointConfig
from trainer.errors import CheckpointError

LOG = logging.getLogger("lease-test")


class Clock:
    """A host's clock, wall and monotonic alike; sleeping advances it (and runs what happens meanwhile)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now
        self.meanwhile: list = []  # called at each sleep: what other hosts do while this one waits
        self.slept = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds
        for happening in self.meanwhile:
            happening()


@pytest.fixture(params=["local", "fsspec", "s3", "azure"])
def location(request: pytest.FixtureRequest, tmp_path) -> str:
    # fsspec's local filesystem: the object-store code path (exclusive "xb" opens) on a real disk; s3: a real
    # S3-compatible server (conditional writes, If-None-Match: *) through s3fs; azure: a real Azure Blob Storage
    # server (Azurite; the same header on the commit of a block list) through adlfs.
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('s3_env').new_bucket()}/ckpt"
    if request.param == "azure":
        return f"az://{request.getfixturevalue('azure_env').new_container()}/ckpt"
    return str(tmp_path / "ckpt") if request.param == "local" else f"local://{tmp_path}/ckpt"


def lease_for(location: str, job: str, clock: Clock | None = None, expires_after_s: float = 60.0,
              job_named: bool = True, max_failed_attempts: int = 0) -> CheckpointLease:
    clock = clock or Clock()
    return CheckpointLease(open_storage(location), job, f"host-{job}", expires_after_s, LOG, clock, job_named,
                           monotonic=clock, sleep=clock.sleep, max_failed_attempts=max_failed_attempts)


def test_a_second_job_is_refused_naming_the_holder_and_the_ways_out(location):
    lease_for(location, "job-a").take()
    with pytest.raises(CheckpointError) as refused:
        lease_for(location, "job-b").take()
    message = str(refused.value)
    assert "is in use by another job (job-a, rank 0 pid" in message and "on host-job-a" in message
    assert "its lease expires in 60s, or pass --take-over-checkpoint-dir" in message


def test_released_expired_or_same_job_leases_are_taken_at_once(location, caplog):
    clock = Clock()
    first = lease_for(location, "job-a", clock)
    first.take()
    first.release()
    second = lease_for(location, "job-b", clock)
    second.take()  # released: a sequential re-run
    lease_for(location, "job-b", clock).take()  # a restart of the same job (torchrun, a requeue, a new pod)
    clock.now += 61  # nobody renewed for longer than the expiry: a job killed without releasing
    with caplog.at_level(logging.WARNING, logger="lease-test"):
        lease_for(location, "job-c", clock).take()
    assert "from job job-b on host-job-b, whose lease expired (not renewed for 61s by its clock" in caplog.text
    assert clock.slept >= 30, "an expired-looking lease is watched for half the expiry before it is taken"
    # Only the newest holder's file is kept.
    assert open_storage(location).files(LEASE_FOLDER) == ["holder-00000004.json"]


def test_renewal_keeps_a_lease_held_past_its_expiry(location):
    clock = Clock()
    holder = lease_for(location, "job-a", clock, expires_after_s=8)
    holder.take()
    for _ in range(5):
        clock.now += 3
        holder.renew()
    with pytest.raises(CheckpointError, match="lease renewed 0s ago"):
        lease_for(location, "job-b", clock, expires_after_s=8).take()


def test_a_job_whose_lease_was_taken_over_stops_before_writing(location, runtime):
    stalled = CheckpointManager(CheckpointConfig(), location, runtime, LOG, Monitor("accuracy", "max"))
    stalled.prepare()
    stalled.save(state_at(1))
    taker = lease_for(location, "job-b")
    if isinstance(taker.storage, storage.FsspecStorage):  # its own client, as on another host: nothing cached shared
        taker.storage.fs = type(taker.storage.fs)(**taker.storage.fs.storage_options, skip_instance_cache=True)
    taker.take(take_over=True)
    with pytest.raises(CheckpointError, match=r"was taken over by job job-b on host-job-b .* stops without writing"):
        stalled.save(state_at(2))
    assert [step_of(name) for name in open_storage(location).list_checkpoints()] == [1]
    stalled.close()  # a lost lease is not released: the holder's file stays the taker's
    with pytest.raises(CheckpointError, match="in use by another job .job-b"):
        lease_for(location, "job-c").take()


def test_of_many_jobs_racing_for_a_free_folder_exactly_one_wins(location):
    racers = [lease_for(location, f"job-{index}") for index in range(8)]
    start = threading.Barrier(len(racers))
    outcomes: list[str] = []

    def race(lease: CheckpointLease) -> None:
        start.wait()
        try:
            lease.take()
            outcomes.append("took")
        except CheckpointError:
            outcomes.append("refused")

    threads = [threading.Thread(target=race, args=(lease,)) for lease in racers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["refused"] * 7 + ["took"]


def test_a_lease_file_being_written_or_damaged_counts_as_held_until_taken_over(location):
    assert Holder.from_bytes(b"{not json") is None and Holder.from_bytes(b'{"job": "a"}') is None
    open_storage(location).create_exclusive(LEASE_FOLDER, "holder-00000001.json", b"")
    with pytest.raises(CheckpointError, match="is being written or is damaged.*--take-over-checkpoint-dir"):
        lease_for(location, "job-a").take()
    lease_for(location, "job-a").take(take_over=True)


def test_a_link_or_a_folder_in_place_of_a_lease_file_is_held_until_taken_over(tmp_path, runtime):
    (tmp_path / LEASE_FOLDER).mkdir(parents=True)
    (tmp_path / LEASE_FOLDER / "holder-00000001.json").mkdir()
    (tmp_path / LEASE_FOLDER / "holder-00000002.json").symlink_to("/etc/hostname")
    manager = CheckpointManager(CheckpointConfig(), str(tmp_path), runtime, LOG, Monitor("accuracy", "max"))
    with pytest.raises(CheckpointError, match="lease file .lease/holder-00000002.json is being written or is damaged"):
        manager.prepare()
    CheckpointManager(CheckpointConfig(take_over_checkpoint_dir=True), str(tmp_path), runtime, LOG,
                      Monitor("accuracy", "max")).prepare()
    assert (tmp_path / LEASE_FOLDER / "holder-00000003.json").is_file()


def test_a_lease_that_cannot_be_written_is_one_clear_error(tmp_path, runtime):
    (tmp_path / LEASE_FOLDER).write_text("a file where the lease's folder goes")
    manager = CheckpointManager(CheckpointConfig(), str(tmp_path), runtime, LOG, Monitor("accuracy", "max"))
    with pytest.raises(CheckpointError, match=r"cannot take the lease of checkpoint folder .*\(File exists\); fix"):
        manager.prepare()


def test_a_taker_whose_clock_runs_ahead_never_takes_a_lease_its_holder_renews(location):
    holder_clock, taker_clock = Clock(), Clock(now=1_000_000.0 + 3600)  # the taker's clock is an hour ahead
    holder = lease_for(location, "job-a", holder_clock, expires_after_s=8)
    holder.take()

    def holder_goes_on() -> None:  # the holder's renewal thread: every quarter of the expiry, by its own clock
        holder_clock.now += 1
        if holder_clock.now % 2 == 0:
            holder.renew()

    taker_clock.meanwhile.append(holder_goes_on)
    with pytest.raises(CheckpointError) as refused:
        lease_for(location, "job-b", taker_clock, expires_after_s=8).take()
    assert "lease renewed while this job watched it, though its timestamps are 3600s old: the two hosts' clocks " \
           "disagree" in str(refused.value)
    holder.renew()  # still the holder: nothing was taken
    # Once the holder stops renewing (killed), the same taker takes the lease after half the expiry.
    taker_clock.meanwhile.clear()
    taker_clock.slept = 0.0
    lease_for(location, "job-b", taker_clock, expires_after_s=8).take()
    assert 4 <= taker_clock.slept <= 5
    holder_clock.now += 5  # the holder wakes up from its stall: told so, and by whom
    with pytest.raises(CheckpointError, match=r"was taken over by job job-b on host-job-b \(rank 0 pid \d+\) while "
                                              r"this job did not renew its lease for [5-9]s \(stalled"):
        holder.renew()


def test_a_job_no_launcher_names_is_told_how_to_name_it_when_refused(location):
    lease_for(location, "torchrun-agent-host-a-4242", job_named=False).take()
    with pytest.raises(CheckpointError) as refused:
        lease_for(location, "torchrun-agent-host-b-777", job_named=False).take()
    assert "name the job with --job-id (or DDP_JOB_ID), the same for every attempt" in str(refused.value)
    with pytest.raises(CheckpointError) as named:
        lease_for(location, "nightly").take()
    assert "--job-id" not in str(named.value)


class OverwritingExclusiveCreate(MemoryFileSystem):
    """What s3fs before 2024.12 did: "xb" written like "wb", so two racing jobs would both take the lease."""

    protocol = "overwrites-test"

    def _open(self, path, mode="rb", **kwargs):  # noqa: ANN001, ANN202 - fsspec's signature
        return super()._open(path, "wb" if mode == "xb" else mode, **kwargs)


class NoExclusiveCreate(MemoryFileSystem):
    """A backend without the mode at all."""

    protocol = "no-exclusive-test"

    def _open(self, path, mode="rb", **kwargs):  # noqa: ANN001, ANN202 - fsspec's signature
        if mode == "xb":
            raise NotImplementedError("mode 'xb'")
        return super()._open(path, mode, **kwargs)


@pytest.mark.parametrize(("backend", "said"), [
    (OverwritingExclusiveCreate, "wrote over a file that its exclusive create should have refused"),
    (NoExclusiveCreate, "has no exclusive create (mode 'xb'), which the checkpoint folder's lease needs"),
])
def test_a_backend_without_a_real_exclusive_create_is_refused_with_one_line(backend, said, runtime):
    fsspec.register_implementation(backend.protocol, backend, clobber=True)
    manager = CheckpointManager(CheckpointConfig(), f"{backend.protocol}://bucket/ckpt", runtime, LOG,
                                Monitor("accuracy", "max"))
    with pytest.raises(CheckpointError) as refused:
        manager.prepare()
    assert said in str(refused.value) and ("use a local or NFS folder, or an object store through s3fs>=2024.12.0 "
                                           "or adlfs>=2024.12.0") in str(refused.value)
    assert manager.lease is None


def test_an_s3fs_older_than_the_first_with_conditional_writes_is_refused_by_its_release(s3_env, runtime, monkeypatch):
    """Against the real server: the installed s3fs passes; one taken for older than the minimum is refused."""
    location = f"s3://{s3_env.new_bucket()}/ckpt"
    CheckpointManager(CheckpointConfig(), location, runtime, LOG, Monitor("accuracy", "max")).prepare()
    monkeypatch.setitem(storage.EXCLUSIVE_CREATE_SINCE, "s3fs", "2999.1.0")
    with pytest.raises(CheckpointError, match=rf"s3fs {fsspec_version('s3fs')} cannot create a file only if it does "
                                              r"not exist.*install s3fs>=2999.1.0"):
        CheckpointManager(CheckpointConfig(), f"s3://{s3_env.new_bucket()}/ckpt", runtime, LOG,
                          Monitor("accuracy", "max")).prepare()


def test_an_adlfs_older_than_the_first_with_an_exclusive_create_is_refused_by_its_release(azure_env, runtime,
                                                                                           monkeypatch):
    """Against Azurite: the installed adlfs passes the start's probe; one taken for older than the minimum is
    refused."""
    CheckpointManager(CheckpointConfig(), f"az://{azure_env.new_container()}/ckpt", runtime, LOG,
                      Monitor("accuracy", "max")).prepare()
    monkeypatch.setitem(storage.EXCLUSIVE_CREATE_SINCE, "adlfs", "2999.1.0")
    with pytest.raises(CheckpointError, match=rf"adlfs {fsspec_version('adlfs')} cannot create a file only if it "
                                              r"does not exist.*install adlfs>=2999.1.0"):
        CheckpointManager(CheckpointConfig(), f"az://{azure_env.new_container()}/ckpt", runtime, LOG,
                          Monitor("accuracy", "max")).prepare()



@pytest.mark.parametrize(("extra", "package"), [("s3", "s3fs"), ("azure", "adlfs")])
def test_each_object_store_extra_installs_a_release_whose_exclusive_create_the_start_accepts(extra, package):
    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras[extra] == [f"{package}>={storage.EXCLUSIVE_CREATE_SINCE[package]}"]

def test_renewals_go_on_after_a_storage_error_that_is_not_an_oserror(tmp_path, monkeypatch):
    """An object store client raises its own errors (botocore's ClientError is no OSError): a renewal that meets
    one is retried at the next turn, not the end of renewals for the rest of the run."""
    holder = CheckpointLease(open_storage(str(tmp_path)), "job-a", "host-a", 0.2, LOG, job_named=True)
    holder.take()
    calls, renewed = [], threading.Event()
    replace_file = holder.storage.replace_file

    def flaky(*args: object) -> None:
        calls.append(args)
        if len(calls) <= 2:
            raise RuntimeError("An error occurred (SlowDown) when calling the PutObject operation")
        replace_file(*args)
        if len(calls) >= 4:
            renewed.set()

    monkeypatch.setattr(holder.storage, "replace_file", flaky)
    holder.start_renewing()
    try:
        assert renewed.wait(30), f"renewals stopped after {len(calls)} attempt(s)"
    finally:
        holder.release()


def test_a_kept_lease_is_the_same_jobs_at_once_and_anothers_once_expired_without_a_watch(location, caplog):
    """Kept by a stopped run for its next attempt (CheckpointManager.release_lease): nobody renews it any more."""
    clock = Clock()
    first = lease_for(location, "job-a", clock)
    first.take()
    first.keep()
    with pytest.raises(CheckpointError, match=r"is kept by job job-a \(on host-job-a\) for its next attempt"):
        lease_for(location, "job-b", clock).take()
    with caplog.at_level(logging.INFO, logger="lease-test"):
        again = lease_for(location, "job-a", clock)
        again.take()  # the next attempt
    assert "took the lease of checkpoint folder" in caplog.text and "took over" not in caplog.text
    again.keep()
    clock.now += 61  # no next attempt came: expired
    lease_for(location, "job-b", clock).take()
    assert clock.slept == 0, "a kept lease has no holder left to renew it: nothing to watch"


HOLDER = """
import logging, sys, time
from trainer.checkpoint import open_storage
from trainer.checkpoint.lease import CheckpointLease
lease = CheckpointLease(open_storage(sys.argv[1]), "shared-id", "host-a", 8.0, logging.getLogger("holder"))
lease.take()
lease.start_renewing()
print("held", flush=True)
time.sleep(120)
"""


def test_a_live_holder_with_this_jobs_identity_is_never_taken_and_one_gone_is_taken_at_once(tmp_path, caplog):
    """Two live jobs with one identity (two Compose stacks on two hosts, one --job-id given twice): the newcomer
    watches the lease, sees it renewed and is refused naming both hosts; the holder goes on. Once the holder's
    process has ended on this host (SIGKILL: nothing released), its next attempt takes the lease at once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    location = str(tmp_path / "ckpt")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, location], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        newcomer = CheckpointLease(open_storage(location), "shared-id", "host-b", 8.0, LOG)
        started = time.monotonic()
        with pytest.raises(CheckpointError) as refused:
            newcomer.take()
        assert time.monotonic() - started < 8, "refused after one watch of two renewal periods"
        assert str(refused.value) == (
            f"checkpoint folder {location} is held by a live job with this job's identity (shared-id): rank 0 pid "
            f"{holder.pid} on host-a renewed its lease while this job (on host-b) watched it, so it is another "
            f"job, not an earlier attempt of this one. Give each job its own identity with --job-id (or "
            f"DDP_JOB_ID), or this one another --checkpoint-dir")
        assert holder.poll() is None, "the holder goes on"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(30)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="lease-test"):
            CheckpointLease(open_storage(location), "shared-id", "host-b", 8.0, LOG).take()
        assert time.monotonic() - started < 1, "a holder whose process ended here is not watched"
        assert (f"from an earlier attempt of this job (shared-id), whose process {holder.pid} on this host has "
                f"ended") in caplog.text
    finally:
        holder.kill()
        holder.wait(30)


def test_this_jobs_earlier_attempt_on_another_host_is_watched_before_its_lease_is_taken(location, caplog):
    """Its process cannot be looked up from here: taken once nobody renewed it for two renewal periods."""
    clock = Clock()
    elsewhere = lease_for(location, "job-a", clock, expires_after_s=8)
    elsewhere.boot = "another-kernel"  # as written on another host
    elsewhere.take()
    with caplog.at_level(logging.WARNING, logger="lease-test"):
        lease_for(location, "job-a", clock, expires_after_s=8).take()
    assert 4 <= clock.slept <= 5
    assert ("took over the lease of checkpoint folder" in caplog.text and "from an earlier attempt of this job "
            "(job-a) on host-job-a, whose lease was not renewed while watched for 4s" in caplog.text), caplog.text


def test_a_job_whose_attempts_keep_failing_without_progress_is_not_retried_past_the_limit(location):
    """Each attempt's record says where it started, what it committed and how it ended; the next attempt of the
    same job counts those in a row that failed (or were killed) without a checkpoint past their start, judged by its
    record and by where this attempt resumes (trainer.checkpoint.attempts)."""
    clock = Clock()

    def attempt(start: int, committed: int, exit_code: int, limit: int = 3, job: str = "job-a",
                restarts: int = 0) -> int:
        lease = CheckpointLease(open_storage(location), job, f"host-{job}", 60.0, LOG, clock, monotonic=clock,
                                sleep=clock.sleep, max_failed_attempts=limit, restart_count=restarts)
        lease.take()
        try:
            lease.started_at(start)
            if committed > start:
                lease.committed(committed)
            lease.attempt.exit_code = exit_code
        except CheckpointError:
            lease.attempt.exit_code = 2  # refused: the process exits 2, and its record says so
            raise
        finally:
            lease.attempt.failure = "3 checkpoint save(s) in a row failed (--max-failed-saves 3)"
            lease.release()
        return lease.attempt.failed_in_a_row

    assert [attempt(10, 10, 200) for _ in range(3)] == [0, 1, 2]
    for _ in range(2):  # the refusal is stable: the refused attempt's own record carries the count on
        with pytest.raises(CheckpointError) as refused:
            attempt(10, 10, 200)
    assert str(refused.value).endswith(
        "the last 3 attempts of this job (job-a) ended without committing a checkpoint past step 10 (the last: exit "
        "2: 3 checkpoint save(s) in a row failed (--max-failed-saves 3)); it is not retried again "
        "(--max-attempts-without-progress 3). Fix the cause, then start it once more with "
        "--max-attempts-without-progress 0"), refused.value
    # Started by hand with no limit, the count begins again.
    assert attempt(10, 10, 200, limit=0) == 0
    # Progress, in the record (committed past its start) or in the folder (this attempt resumes past the last one's
    # start), ends the count.
    assert attempt(10, 14, 200) == 1 and attempt(14, 14, 200) == 0 and attempt(20, 20, 200) == 0
    # A bad input's exit (2) and a preemption (143) carry the count on; a preemption that the launcher answered with
    # a restart (torchrun stops every rank when any fails, and counts a restart only then) counts.
    assert [attempt(20, 20, code, limit=9) for code in (200, 2, 200, 143, 200)] == [1, 2, 2, 3, 3]
    assert attempt(20, 20, 143, restarts=1, limit=9) == 4
    assert attempt(20, 20, 200, restarts=2, limit=9) == 5
    assert attempt(20, 20, 200, job="job-b") == 0  # another job's record: its own count
    # Killed without an exit (out of memory): its record was never ended, and it counts.
    killed = lease_for(location, "job-b", clock, max_failed_attempts=3)
    killed.take()
    killed.started_at(14)
    killed.boot = ""  # its process cannot be looked up from here: watched, then taken
    killed.renew()
    taker = lease_for(location, "job-b", clock, max_failed_attempts=3)
    taker.take()
    taker.started_at(14)
    assert taker.attempt.failed_in_a_row == 2
    taker.release()
    # Attempts that end before they know where they resume (a resume that fails, a kill while loading) count too.
    assert attempt(30, 30, 200, job="job-c") == 0
    for count in (1, 2):
        failing = lease_for(location, "job-c", clock, max_failed_attempts=3)
        failing.take()
        failing.attempt.exit_code = 200
        failing.release()
        assert failing.attempt.failed_in_a_row == count
    third = lease_for(location, "job-c", clock, max_failed_attempts=3)
    third.take()
    with pytest.raises(CheckpointError, match=r"the last 3 attempts of this job \(job-c\) ended without committing a "
                                              r"checkpoint past where it started \(the last: exit 200"):
        third.started_at(30)


def test_a_renewal_that_ends_after_the_release_leaves_the_released_record(tmp_path, monkeypatch):
    """_end waits for the renewer only so long (a hung storage): a renewal still being written must not overwrite
    the last record (the next attempt would watch a released lease, and count a finished attempt as killed)."""
    import time

    from trainer.checkpoint import lease as lease_module

    monkeypatch.setattr(lease_module, "RENEWER_JOIN_S", 0.1)
    lease = CheckpointLease(open_storage(str(tmp_path)), "job-a", "host-a", 4.0, LOG)
    lease.take()
    replace_file = lease.storage.replace_file
    renewing = threading.Event()

    def slow_for_the_renewer(name: str, filename: str, data: bytes) -> None:
        if threading.current_thread().name == "checkpoint-lease":
            renewing.set()
            time.sleep(1.0)
        replace_file(name, filename, data)

    monkeypatch.setattr(lease.storage, "replace_file", slow_for_the_renewer)
    lease.start_renewing()
    lease.record_soon()
    assert renewing.wait(10)
    lease.attempt.exit_code = 0
    lease.release()
    time.sleep(3.0)  # the renewal in flight ends meanwhile
    (record,) = open_storage(str(tmp_path)).files(LEASE_FOLDER)
    holder = Holder.from_bytes(open_storage(str(tmp_path)).read(LEASE_FOLDER, record))
    assert holder is not None and holder.released and holder.attempt.exit_code == 0, holder
