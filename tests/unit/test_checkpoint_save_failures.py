"""A save that fails on a storage error a retry may fix is not the end of the run: a periodic one is a warning and
training goes on, up to --max-failed-saves in a row (then exit 200, naming the last committed checkpoint); the final
one is tried again until its deadline. Errors a retry cannot fix stay exit 2. One process, world size 1: the same
outcome reaches every rank through CheckpointManager._settle's broadcast, tested with real ranks in
tests/integration/test_checkpoint_faults.py."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Iterator

import pytest

from tests.support.checkpoint_reading import state_at
from trainer.checkpoint import CheckpointManager, Monitor, open_storage
from trainer.checkpoint import lease as lease_module
from trainer.checkpoint.manager import SaveRetry
from trainer.checkpoint.save_failures import is_transient
from trainer.checkpoint.storage import step_of
from trainer.config import CheckpointConfig
from trainer.errors import EXIT_PEER_LOST, EXIT_USAGE, CheckpointError, StorageUnavailable

LOG = "save-failures-test"


@pytest.fixture
def manager_for(runtime, caplog) -> Iterator[Callable[..., CheckpointManager]]:
    caplog.set_level(logging.INFO, logger=LOG)
    made: list[CheckpointManager] = []

    def make(location: str, **config: object) -> CheckpointManager:
        manager = CheckpointManager(CheckpointConfig(**config), location, runtime,  # type: ignore[arg-type]
                                    logging.getLogger(LOG), Monitor("accuracy", "max"))
        manager.prepare()
        made.append(manager)
        return manager
    yield make
    for manager in made:  # no lease renewal thread outlives its test (as in test_checkpoint_manager.py)
        manager.close()


def failing_state_files(manager: CheckpointManager, monkeypatch: pytest.MonkeyPatch, error: OSError,
                        steps: set[int]) -> None:
    """The state file of the saves of ``steps`` fails to write with ``error`` (an EIO from NFS, a 5xx from a store)."""
    storage = manager.storage
    write_file = storage.write_file

    def failing(temporary: str, filename: str, write_content: object) -> object:
        if filename == "state.pt" and any(f"step-{step:08d}" in temporary for step in steps):
            raise error
        return write_file(temporary, filename, write_content)  # type: ignore[arg-type]

    monkeypatch.setattr(storage, "write_file", failing)


def committed(location: str) -> list[int]:
    return [step_of(name) or 0 for name in open_storage(location).list_checkpoints()]


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_periodic_saves_that_fail_on_a_storage_error_are_warnings_until_too_many_fail_in_a_row(
        manager_for, tmp_path, monkeypatch, caplog, asynchronous):
    location = str(tmp_path / "ckpt")
    manager = manager_for(location, max_failed_saves=3, async_checkpoint=asynchronous)
    manager.save(state_at(1))
    failing_state_files(manager, monkeypatch, OSError(errno.EIO, "Input/output error"), {2, 3, 5, 6, 7})
    for step in (2, 3, 4, 5, 6):  # two failures, one that commits (the count starts again), two more
        manager.save(state_at(step))
    manager.finish()
    assert committed(location) == [4, 1]
    said = warnings(caplog)
    assert len(said) == 4, said
    assert said[0] == (f"checkpoint at step 2 not saved (1 of --max-failed-saves 3 in a row): could not write "
                       f"checkpoint {location}/step-00000002: Input/output error. The previous checkpoints are "
                       f"untouched. Training goes on; the next save tries again. The last committed checkpoint is "
                       f"{location}/step-00000001"), said[0]
    assert said[3].startswith("checkpoint at step 6 not saved (2 of --max-failed-saves 3 in a row)"), said[3]
    assert said[3].endswith(f"The last committed checkpoint is {location}/step-00000004"), said[3]
    assert manager.committed_step == 4
    with pytest.raises(StorageUnavailable) as ended:
        manager.save(state_at(7))
        manager.finish()
    assert str(ended.value) == (
        f"3 checkpoint save(s) in a row failed (--max-failed-saves 3), the last at step 7: could not write checkpoint "
        f"{location}/step-00000007: Input/output error. The previous checkpoints are untouched. The last committed "
        f"checkpoint is {location}/step-00000004; the job ends to be restarted from it")
    assert ended.value.exit_code == EXIT_PEER_LOST
    assert committed(location) == [4, 1]  # nothing lost, nothing half-written left as a checkpoint
    assert [path.name for path in (tmp_path / "ckpt").iterdir() if path.name.startswith(".tmp")] == []


def test_errors_a_retry_cannot_fix_end_the_run_at_once_as_errors_of_the_input(manager_for, tmp_path, monkeypatch):
    location = str(tmp_path / "ckpt")
    manager = manager_for(location, max_failed_saves=5)
    manager.save(state_at(1))
    failing_state_files(manager, monkeypatch, PermissionError(errno.EACCES, "Permission denied"), {2})
    with pytest.raises(CheckpointError) as refused:
        manager.save(state_at(2))
    assert not isinstance(refused.value, StorageUnavailable) and refused.value.exit_code == EXIT_USAGE
    assert "Permission denied" in str(refused.value) and "fix permissions on" in str(refused.value)
    assert committed(location) == [1]


def test_a_final_save_is_tried_again_until_its_deadline_then_ends_the_run_to_be_restarted(manager_for, tmp_path,
                                                                                         monkeypatch):
    location = str(tmp_path / "ckpt")
    manager = manager_for(location, max_failed_saves=1)  # the bound is for periodic saves: a final one retries
    manager.save(state_at(1))
    failing_state_files(manager, monkeypatch, OSError(errno.EBUSY, "Please reduce your request rate."), {2})
    delays = []
    for _ in range(3):
        with pytest.raises(SaveRetry) as retry:
            manager.save(state_at(2), final_deadline=time.monotonic() + 60)
        delays.append(retry.value.delay_s)
    assert delays == [1.0, 2.0, 4.0]  # backing off
    assert "the final checkpoint at step 2 was not saved: could not write checkpoint" in str(retry.value)
    with pytest.raises(StorageUnavailable, match=r"^the final checkpoint at step 2 was not saved, retried until its "
                                                 r"deadline: .*Please reduce your request rate.* The last committed "
                                                 r"checkpoint is .*/step-00000001; the job ends to be restarted"):
        manager.save(state_at(2), final_deadline=time.monotonic() + 5)  # 8 s would be the next pause
    monkeypatch.undo()
    manager.save(state_at(2), final_deadline=time.monotonic() + 60)
    manager.finish()
    assert committed(location) == [2, 1] and manager.committed_step == 2


def test_a_lease_the_storage_does_not_return_is_read_again_not_taken_for_lost(manager_for, tmp_path, monkeypatch,
                                                                             caplog):
    location = str(tmp_path / "ckpt")
    manager = manager_for(location, max_failed_saves=2)
    monkeypatch.setattr(lease_module, "READ_RETRIES_S", (0.0, 0.0, 0.0))
    assert manager.lease is not None
    check = manager.lease.check
    failures = {"left": 2}

    def flaky() -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(errno.EBUSY, "Please reduce your request rate.")
        check()

    monkeypatch.setattr(manager.lease, "check", flaky)
    manager.save(state_at(1))  # two failed reads, then the third: committed
    assert committed(location) == [1] and warnings(caplog) == []
    failures["left"] = 1000
    manager.save(state_at(2))  # never readable: the save fails as on any storage error, a warning
    # (The lease's renewer, which writes each commit's progress into it, warns of its own failed reads.)
    said = [line for line in warnings(caplog) if not line.startswith("could not renew the lease")]
    assert len(said) == 1 and "could not read the lease of checkpoint folder" in said[0], said
    assert "4 tries)" in said[0] and "taken over" not in said[0], said[0]
    failures["left"] = 0
    manager.save(state_at(3))
    assert committed(location) == [3, 1]


@pytest.mark.parametrize(("error", "transient"), [
    (OSError(errno.EIO, "Input/output error"), True),
    (OSError(errno.EBUSY, "Please reduce your request rate."), True),  # s3fs's SlowDown, 503
    (TimeoutError("timed out"), True),
    (ConnectionResetError(errno.ECONNRESET, "reset"), True),
    (PermissionError(errno.EACCES, "denied"), False),
    (FileNotFoundError(errno.ENOENT, "no such bucket"), False),
    (OSError(errno.ENOSPC, "full"), False),
    (StorageUnavailable("stalled store"), True),
    (CheckpointError("taken over"), False),
    (TypeError("cannot pickle"), False),
    (PermissionError("Access Denied"), False),  # s3fs's, for AccessDenied: no errno
    (OSError("Forbidden: 403 POST https://storage.googleapis.com/upload"), False),  # gcsfs's 403: no errno
    (OSError(errno.EFBIG, "File too large"), False),
    (OSError(errno.ELOOP, "Too many levels of symbolic links"), False),
    (type("DefaultCredentialsError", (Exception,), {})("no credentials"), False),  # google.auth's
    (type("HttpError", (OSError,), {"code": 503})("Service Unavailable"), True),  # gcsfs's, with its status
    (type("HttpError", (OSError,), {"code": 403})("Forbidden"), False),
    (type("ServerDisconnectedError", (Exception,), {})("Server disconnected"), True),  # aiohttp's
])
def test_which_errors_a_retry_may_fix(error, transient):
    assert is_transient(error) is transient


def test_a_storage_clients_own_errors_are_told_apart_by_their_codes():
    botocore = pytest.importorskip("botocore.exceptions")
    throttled = botocore.ClientError({"Error": {"Code": "SlowDown", "Message": "slow down"}}, "PutObject")
    denied = botocore.ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "PutObject")
    missing = botocore.ClientError({"Error": {"Code": "NoSuchBucket", "Message": "no"}}, "PutObject")
    unreachable = botocore.EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
    no_credentials = botocore.NoCredentialsError()
    assert [is_transient(error) for error in (throttled, denied, missing, unreachable, no_credentials)] == [
        True, False, False, True, False]
    s3fs_errors = pytest.importorskip("s3fs.errors")  # what s3fs makes of them: errno-less PermissionError, EBUSY
    assert [is_transient(s3fs_errors.translate_boto_error(error)) for error in (throttled, denied, missing)] == [
        True, False, False]
    # s3fs gives a corrupted upload and a bad bucket name the same EINVAL: the code it keeps as the cause tells.
    bad_digest = botocore.ClientError({"Error": {"Code": "BadDigest", "Message": "no match"}}, "PutObject")
    bad_name = botocore.ClientError({"Error": {"Code": "InvalidBucketName", "Message": "bad"}}, "PutObject")
    assert [is_transient(s3fs_errors.translate_boto_error(error)) for error in (bad_digest, bad_name)] == [True, False]
    # Another store's own codes (MinIO's): its HTTP status tells, on botocore's error and behind s3fs's EIO.
    def answered(code: str, status: int) -> Exception:
        return botocore.ClientError({"Error": {"Code": code, "Message": code},
                                     "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    minio = [answered("SlowDownWrite", 503), answered("XMinioServerNotInitialized", 503),
             answered("XAmzContentSHA256Mismatch", 400)]
    assert [is_transient(error) for error in minio] == [True, True, False]
    assert [is_transient(s3fs_errors.translate_boto_error(error)) for error in minio] == [True, True, False]


def wrapped(outer: BaseException, cause: BaseException) -> BaseException:
    """``raise outer from cause``, as adlfs raises its own errors."""
    try:
        raise outer from cause
    except BaseException as error:  # noqa: BLE001 - the error as raised, its __cause__ set
        return error


def test_azures_errors_are_told_apart_by_their_status_also_where_adlfs_wraps_them():
    """adlfs wraps a failed upload as ``RuntimeError(f"Failed to upload block: {e}!") from e`` and a container it
    could not check as ValueError: a generic wrapper, so the azure-core error under it decides. A specific error
    (its FileExistsError for a lost exclusive create, a PermissionError) decides itself."""
    azure = pytest.importorskip("azure.core.exceptions")

    def answered(kind: type, status: int, code: str) -> BaseException:
        response = type("Response", (), {"status_code": status, "reason": code, "headers": {}, "text": lambda self: ""})
        error = kind(message=code, response=response())
        error.error_code = code
        return error

    dropped = azure.ServiceRequestError("Cannot connect to host 127.0.0.1:10000 [Connect call failed]")
    cut = azure.ServiceResponseError("Server disconnected")
    busy = answered(azure.HttpResponseError, 503, "ServerBusy")
    timed_out = answered(azure.HttpResponseError, 500, "OperationTimedOut")
    throttled = answered(azure.HttpResponseError, 429, "TooManyRequests")
    slow = answered(azure.HttpResponseError, 408, "RequestTimeout")
    denied = answered(azure.HttpResponseError, 403, "AuthorizationFailure")
    unauthenticated = answered(azure.ClientAuthenticationError, 403, "AuthenticationFailed")
    no_container = answered(azure.ResourceNotFoundError, 404, "ContainerNotFound")
    exists = answered(azure.ResourceExistsError, 409, "BlobAlreadyExists")
    errors = [dropped, cut, busy, timed_out, throttled, slow, denied, unauthenticated, no_container, exists]
    verdicts = [True, True, True, True, True, True, False, False, False, False]
    assert [is_transient(error) for error in errors] == verdicts
    assert [is_transient(wrapped(RuntimeError(f"Failed to upload block: {error}!"), error))
            for error in errors] == verdicts
    assert [is_transient(wrapped(ValueError(f"Failed to fetch container properties for ckpt for {error}"), error))
            for error in errors] == verdicts
    assert is_transient(wrapped(RuntimeError("outer"), wrapped(RuntimeError("Failed to upload block"), dropped)))
    # adlfs's lost exclusive create (the lease takes it for another job's win) and errors that say what they are.
    assert not is_transient(wrapped(FileExistsError("ckpt/.lease/holder-00000002.json"), exists))
    assert not is_transient(wrapped(PermissionError("Azure Container does not exist"), dropped))
    assert not is_transient(wrapped(CheckpointError("taken over"), dropped))
    assert not is_transient(RuntimeError("Failed to upload block: no cause!"))
    assert not is_transient(wrapped(RuntimeError("Failed to upload block"), TypeError("cannot pickle")))


def test_whether_a_retry_may_fix_an_error_is_decided_where_it_happened_and_relayed_with_it():
    """DCP relays a rank's error to the others as a plain picklable one (dcp_errors.plain): an s3fs PermissionError
    has no errno, and a botocore ClientError becomes its name and words; the verdict travels with it."""
    import pickle

    from trainer.checkpoint.dcp_errors import plain
    from trainer.checkpoint.reading import StorageUnreadable, agree

    relayed = [pickle.loads(pickle.dumps(plain(error))) for error in (
        PermissionError("Access Denied"), OSError(errno.EIO, "Input/output error"),
        type("ClientError", (Exception,), {"response": {"Error": {"Code": "AccessDenied"}}})("denied"),
        type("EndpointConnectionError", (Exception,), {})("unreachable"))]
    assert [is_transient(error) for error in relayed] == [False, True, False, True]
    # A resume's read that the storage did not return, agreed between the ranks: exit 200 where a retry may read it.
    with pytest.raises(StorageUnreadable) as unread:
        agree(None, "rank 1: .metadata unreadable (Please reduce your request rate.)", stops=True, transient=True)
    assert unread.value.exit_code == EXIT_PEER_LOST
    with pytest.raises(CheckpointError) as refused:
        agree(None, "rank 1: .metadata unreadable (Permission denied)", stops=True)
    assert refused.value.exit_code == EXIT_USAGE
