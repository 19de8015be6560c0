"""CheckpointManager and its storage in one process (world size 1): what is written, what is refused on
loading and why, what retention keeps, and what asynchronous saving promises."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import fsspec
import pytest
import torch

from tests.support.checkpoint_damage import break_checkpoint, checkpoint_bytes
from tests.support.checkpoint_reading import state_at, whole
from trainer.checkpoint import CheckpointManager, Monitor, open_storage, verify
from trainer.checkpoint.manager import RELEASE_AFTER_STALL_S, Committed, InvalidCheckpoint
from trainer.checkpoint.storage import LocalStorage, step_of
from trainer.config import CheckpointConfig
from trainer.distributed import Runtime
from trainer.errors import EXIT_PEER_LOST, CheckpointError, StorageStalled


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> logging.Logger:
    caplog.set_level(logging.INFO, logger="checkpoint-test")
    return logging.getLogger("checkpoint-test")


ManagerFactory = Callable[..., CheckpointManager]


@pytest.fixture
def manager_for(runtime: Runtime, log: logging.Logger) -> Iterator[ManagerFactory]:
    made: list[CheckpointManager] = []

    def make(location: str, **config: object) -> CheckpointManager:
        # A failed save raises at once, as it would after --max-failed-saves in a row (the tolerance is tested
        # with the option given).
        config.setdefault("max_failed_saves", 1)
        manager = CheckpointManager(CheckpointConfig(**config), location, runtime, log,  # type: ignore[arg-type]
                                    Monitor("accuracy", "max"))
        manager.prepare()
        made.append(manager)
        return manager
    yield make
    # Each lease released, so that no renewal thread outlives its test: one that failed later logged its warning
    # into another test's captured log (seen in tests/unit/test_trackers.py).
    for manager in made:
        manager.close()


def save_steps(manager: CheckpointManager, steps: list[int], accuracy: dict[int, float] | None = None) -> None:
    for step in steps:
        metrics = {"accuracy": accuracy[step]} if accuracy and step in accuracy else None
        manager.save(state_at(step), metrics)
    manager.finish()


def has_tensors(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else []
    return any(has_tensors(item) for item in items)


def names(location: str) -> list[str]:
    return open_storage(location).list_checkpoints()


# -- loading: a broken newest checkpoint is reported and skipped ---------------------------------------------

DEFECTS = {
    "flipped-bytes": "does not match the manifest's crc32 checksum",
    "truncated": "bytes, the manifest says",
    "checksum-mismatch": "does not match the manifest's crc32 checksum",
    "size-mismatch": "bytes, the manifest says",
    "missing-manifest": "no manifest (the save did not finish)",
    "unparseable-manifest": "manifest.json is not valid JSON",
    "manifest-without-checksum": "manifest.json has no 'crc32' entry",
    "pickled-object": "does not load with weights_only=True (Unsupported global",
    "linked-state": "state.pt is a symbolic link; a checkpoint folder holds only the files the trainer wrote",
    "fifo-state": "state.pt is not a regular file; a checkpoint folder holds only the files the trainer wrote",
    "huge-manifest": "manifest.json is larger than any manifest this trainer writes (1048576 bytes at most)",
}


def _blocked(signum: int, frame: object) -> None:
    raise AssertionError("loading the checkpoint blocked for 30 s")


@pytest.mark.parametrize("defect", DEFECTS)
def test_a_broken_newest_checkpoint_is_skipped_with_its_reason_for_the_previous_one(defect, manager_for, tmp_path,
                                                                                     caplog):
    manager = manager_for(str(tmp_path))
    save_steps(manager, [1, 2])
    break_checkpoint(tmp_path / "step-00000002", defect, marker=tmp_path / "executed")
    previous = signal.signal(signal.SIGALRM, _blocked)  # a FIFO read would block: fail, do not hang the suite
    signal.alarm(30)
    try:
        loaded = manager_for(str(tmp_path)).load("latest")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert loaded is not None and loaded.location.endswith("step-00000001")
    skipped = [record.getMessage() for record in caplog.records if record.getMessage().startswith("skipping")]
    assert len(skipped) == 1 and "step-00000002: " in skipped[0] and DEFECTS[defect] in skipped[0], skipped
    assert "\n" not in skipped[0]
    assert not (tmp_path / "executed").exists(), "loading ran code from the checkpoint"


@pytest.mark.parametrize(("version", "message"), [
    (1, "format 1, which this trainer cannot read (it reads 2, 3, 4, 5)"),
    (6, "format 6, which this trainer cannot read (it reads 2, 3, 4, 5); it was written by a newer ddp-deploy"),
])
def test_a_checkpoint_in_an_unknown_format_is_refused_not_skipped(version, message, manager_for, tmp_path):
    """Skipping it would start afresh and, later, prune the checkpoints this trainer could not read."""
    save_steps(manager_for(str(tmp_path)), [1, 2])
    break_checkpoint(tmp_path / "step-00000002", "format", version=version)
    for resume in ("latest", str(tmp_path / "step-00000002")):
        with pytest.raises(CheckpointError) as raised:
            manager_for(str(tmp_path)).load(resume)
        assert message in str(raised.value) and "--resume none" in str(raised.value)
    assert names(str(tmp_path)) == ["step-00000002", "step-00000001"]


def test_a_state_file_of_the_wrong_size_is_not_read(manager_for, tmp_path, monkeypatch):
    save_steps(manager_for(str(tmp_path)), [1])
    break_checkpoint(tmp_path / "step-00000001", "size-mismatch")
    reads = []
    original = LocalStorage.read
    monkeypatch.setattr(LocalStorage, "read", lambda self, name, filename: reads.append(filename) or
                        original(self, name, filename))
    with pytest.raises(InvalidCheckpoint, match="state.pt has .* bytes, the manifest says"):
        verify(open_storage(str(tmp_path)), "step-00000001")
    assert reads == ["manifest.json"]


def test_resume_path_to_a_broken_checkpoint_is_one_line_naming_the_reason_and_the_way_out(manager_for, tmp_path):
    manager = manager_for(str(tmp_path))
    save_steps(manager, [1, 2])
    break_checkpoint(tmp_path / "step-00000002", "truncated")
    with pytest.raises(CheckpointError) as raised:
        manager.load(str(tmp_path / "step-00000002"))
    message = str(raised.value)
    assert "\n" not in message and "bytes, the manifest says" in message and "--resume latest" in message


def test_resume_path_that_does_not_exist_says_so(manager_for, tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        manager_for(str(tmp_path)).load(str(tmp_path / "step-00000007"))


def test_no_checkpoint_means_a_fresh_start(manager_for, tmp_path):
    assert manager_for(str(tmp_path / "empty")).load("latest") is None


# -- writing -------------------------------------------------------------------------------------------------

def test_a_save_leaves_exactly_one_committed_folder_whose_manifest_describes_it(manager_for, tmp_path):
    save_steps(manager_for(str(tmp_path)), [5])
    # Beside it only the folder's lease (trainer.checkpoint.lease): no temporary, no probe.
    assert sorted(path.name for path in tmp_path.iterdir()) == [".lease", "step-00000005"]
    loaded = verify(open_storage(str(tmp_path)), "step-00000005")
    assert loaded.manifest["step"] == 5
    assert loaded.manifest["files"]["state.pt"]["bytes"] == (tmp_path / "step-00000005" / "state.pt").stat().st_size
    assert torch.equal(loaded.state.model["weight"], state_at(5).model["weight"])
    assert set(loaded.state.parts["rng"][0]) >= {"python", "numpy", "torch"} and "torch" in loaded.state.versions


def test_a_checkpoint_moved_aside_for_replacement_is_put_back_when_the_save_crashed(manager_for, tmp_path):
    save_steps(manager_for(str(tmp_path)), [3])
    # What a crash between LocalStorage._commit's two renames leaves: the old one aside, the new one
    # still under its temporary name.
    (tmp_path / "step-00000003").rename(tmp_path / ".tmp-replaced-step-00000003-0badc0de")
    (tmp_path / ".tmp-step-00000003-12345678").mkdir()
    manager_for(str(tmp_path))
    assert sorted(path.name for path in tmp_path.iterdir()) == [".lease", "step-00000003"]
    verify(open_storage(str(tmp_path)), "step-00000003")


def test_saving_a_step_that_exists_replaces_it(manager_for, tmp_path):
    save_steps(manager_for(str(tmp_path)), [4])
    manager = manager_for(str(tmp_path))
    manager.save(state_at(4, torch.ones(2)))
    assert sorted(path.name for path in tmp_path.iterdir()) == [".lease", "step-00000004"]
    assert torch.equal(verify(open_storage(str(tmp_path)), "step-00000004").state.model["weight"], torch.ones(2))


def steps(location: str) -> list[int]:
    return [step_of(name) or 0 for name in names(location)]


@pytest.mark.parametrize("crash_at", [None, "state.pt", "manifest.json", "removal"])
def test_on_an_object_store_each_save_is_a_folder_of_its_own_committed_by_its_manifest_never_moved(
        crash_at, manager_for, monkeypatch):
    """A save of a step that has a checkpoint writes beside it, in its own folder, and nothing is moved (a move on
    S3 copies every object): the new manifest commits it, then the old one is removed. A crash at any file's upload
    leaves the old checkpoint whole and the next run's start removes the uncommitted folder; one at the old one's
    removal leaves both, the later read first and the older removed by the next save."""
    location = f"memory://ckpt-{uuid.uuid4().hex}"
    save_steps(manager_for(location), [4])
    [old] = names(location)
    fs, root = fsspec.core.url_to_fs(location)
    monkeypatch.setattr(type(fs), "mv", lambda *args, **kwargs: pytest.fail(f"a save moved {args[1:]}"))
    opened, removed = type(fs).open, type(fs).rm

    def crashing_open(self: object, path: str, mode: str = "rb", **kwargs: object) -> object:
        if path.endswith(f"/{crash_at}") and "w" in mode:
            raise OSError(5, "Input/output error")
        return opened(self, path, mode, **kwargs)

    def crashing_remove(self: object, path: str, *args: object, **kwargs: object) -> object:
        if old in path:
            raise OSError(5, "Input/output error")
        return removed(self, path, *args, **kwargs)

    monkeypatch.setattr(type(fs), "open", crashing_open)
    if crash_at == "removal":
        monkeypatch.setattr(type(fs), "rm", crashing_remove)
    manager = manager_for(location, keep_last=3)
    if crash_at in (None, "removal"):
        manager.save(state_at(4, torch.ones(2)))
        [new] = [name for name in names(location) if name != old]
        assert new.startswith("step-00000004.") and manager.last_committed == new
        assert names(location) == ([new, old] if crash_at else [new])
        monkeypatch.setattr(type(fs), "rm", removed)
        resumed = manager_for(location, keep_last=3)  # the next run
        loaded = resumed.load("latest")
        assert loaded is not None and loaded.location.endswith(new)
        assert torch.equal(whole(loaded)["model"]["weight"], torch.ones(2))
        resumed.save(state_at(5))
        assert names(location)[1:] == [new]  # keep_last 3: the earlier save of step 4 is no fallback
        return
    with pytest.raises(CheckpointError, match=r"could not write checkpoint memory://ckpt-\w+/step-00000004: "):
        manager.save(state_at(4, torch.ones(2)))
    monkeypatch.setattr(type(fs), "open", opened)
    assert names(location) == [old]
    manager_for(location)  # the next run's start removes what an uncommitted save left
    assert [path.rsplit("/", 1)[-1] for path in fs.ls(root, detail=False)] == [".lease", old]
    assert torch.equal(verify(open_storage(location), old).state.model["weight"], state_at(4).model["weight"])


def test_on_an_object_store_a_late_save_of_the_same_step_never_touches_the_committed_one(manager_for, monkeypatch):
    """A job frozen past its lease (a paused VM) wakes up and goes on saving a step the job that took the folder
    over has committed: its writes and its clean-up land in its own folder only, which sorts as the older save of
    the step (its lease generation is the older) even where its host's clock runs an hour ahead; the next start
    removes it unfinished, and again once the late job's manifest lands in it, its files gone."""
    location = f"memory://ckpt-{uuid.uuid4().hex}"
    save_steps(manager_for(location), [4])
    [committed] = names(location)
    late, now = open_storage(location), time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: now() + 3600 * 10**9)
    folder = late.begin("step-00000004", generation=0)  # the late job's lease generation: older than the holder's
    late.write_file(folder, "state.pt", lambda handle: handle.write(b"the late job's bytes"))
    late.abandon(folder)  # its failed save cleans up
    torn = late.begin("step-00000004", generation=0)
    late.write_file(torn, "state.pt", lambda handle: handle.write(b"the late job's bytes"))
    monkeypatch.setattr(time, "time_ns", now)
    assert names(location) == [committed, torn]
    manager_for(location, take_over_checkpoint_dir=True)  # the next run's start
    assert names(location) == [committed]
    # The late job passed its last lease check before the takeover and uploads its manifest into its emptied folder.
    late.commit(torn, "step-00000004", {}, {"state.pt": {"bytes": 20, "crc32": "0"}},
                lambda files: json.dumps({"format": 3, "files": files}).encode())
    assert names(location) == [committed, torn]
    loaded = manager_for(location, take_over_checkpoint_dir=True).load("latest")
    assert loaded is not None and loaded.location.endswith(committed) and names(location) == [committed]
    assert torch.equal(whole(loaded)["model"]["weight"], state_at(4).model["weight"])


@pytest.mark.parametrize("failing", [("cat_file",), ("ls", "info")])
def test_on_an_object_store_a_store_that_does_not_answer_at_the_start_removes_nothing(failing, manager_for,
                                                                                      monkeypatch):
    """The start removes save folders that will never be whole: a manifest read or a listing that fails (throttled,
    timed out) decides nothing, where fsspec's own isfile and isdir would have answered False."""
    location = f"memory://ckpt-{uuid.uuid4().hex}"
    save_steps(manager_for(location), [2, 4])
    before = names(location)
    fs, _ = fsspec.core.url_to_fs(location)

    def flaky(real: Callable[..., object]) -> Callable[..., object]:
        def call(self: object, path: str, *args: object, **kwargs: object) -> object:
            if "/step-" in path:
                raise OSError(5, "Input/output error")
            return real(self, path, *args, **kwargs)
        return call

    with monkeypatch.context() as patched:
        for method in failing:
            patched.setattr(type(fs), method, flaky(getattr(type(fs), method)))
        manager_for(location, take_over_checkpoint_dir=True)
    assert names(location) == before and all(verify(open_storage(location), name) for name in before)


def test_on_an_object_store_a_listing_that_fails_stops_the_resume_never_starts_afresh(manager_for, monkeypatch):
    location = f"memory://ckpt-{uuid.uuid4().hex}"
    save_steps(manager_for(location), [2])
    fs, _ = fsspec.core.url_to_fs(location)
    manager = manager_for(location, take_over_checkpoint_dir=True)

    def failing(*args: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(type(fs), "ls", failing)
    with pytest.raises(CheckpointError, match=r"^cannot list checkpoint folder memory://ckpt-\w+ \(OSError: "
                                              r"\[Errno 5\] Input/output error\); the run does not start afresh "
                                              r"over checkpoints it cannot see: start it again once the storage "
                                              r"answers, or pass --resume none$"):
        manager.load("latest")


def test_on_an_object_store_a_listing_that_fails_at_the_start_or_in_pruning_leaves_everything_and_stops_nothing(
        manager_for, monkeypatch, caplog):
    """Cleaning up and pruning are for later when the store does not answer: the run starts, the save stands."""
    location = f"memory://ckpt-{uuid.uuid4().hex}"
    save_steps(manager_for(location), [1, 2])
    fs, root = fsspec.core.url_to_fs(location)
    listing = type(fs).ls

    def failing_at_the_root(self: object, path: str, *args: object, **kwargs: object) -> object:
        if path.rstrip("/") == root.rstrip("/"):
            raise OSError(5, "SlowDown: Please reduce your request rate")
        return listing(self, path, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(type(fs), "ls", failing_at_the_root)
        manager = manager_for(location, keep_last=2, take_over_checkpoint_dir=True)
        manager.save(state_at(3))
    assert steps(location) == [3, 2, 1]  # committed; the next save prunes
    warned = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert any(line.startswith("left what earlier saves may have left in memory://") for line in warned), warned
    assert any("the older ones were not pruned: cannot list memory://" in line for line in warned), warned
    manager.save(state_at(4))
    assert steps(location) == [4, 3]


def test_a_state_file_that_a_storage_client_cannot_read_stops_the_resume_in_one_line_and_leaves_no_copy(
        manager_for, monkeypatch, tmp_path):
    """An object store client's own error (botocore's are no OSError) while each rank maps the state file: one
    line, the resume stops (the checkpoint is not skipped for an older one), and the node's copy is gone."""
    location = f"memory://ckpt-{uuid.uuid4().hex}"
    save_steps(manager_for(location), [1])
    loaded = manager_for(location, take_over_checkpoint_dir=True).load("latest")
    assert loaded is not None and loaded.resume
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    class EndpointConnectionError(Exception):  # as botocore's: an Exception, not an OSError
        pass

    def unreachable(*args: object, **kwargs: object) -> bytes:
        raise EndpointConnectionError('Could not connect to the endpoint URL: "http://127.0.0.1:9/bucket"')

    fs, _ = fsspec.core.url_to_fs(location)
    monkeypatch.setattr(type(fs), "cat_file", unreachable)
    with pytest.raises(CheckpointError, match=r'^state.pt unreadable \(Could not connect to the endpoint URL: '
                                              r'"http://127.0.0.1:9/bucket"\)$'):
        whole(loaded)
    assert list((tmp_path / f"ddp-deploy-{os.getuid()}").iterdir()) == []


def test_on_an_object_store_a_state_file_the_store_does_not_return_stops_the_resume_never_skips_it(
        manager_for, monkeypatch, tmp_path):
    """A throttled or failed read of the newest checkpoint: not a reason to resume an older one (or none, and then
    prune the good one when training reaches its step again); rank 0's own copy is made in the private folder."""
    location = f"memory://ckpt-{uuid.uuid4().hex}"
    save_steps(manager_for(location), [4, 8])
    manager = manager_for(location, take_over_checkpoint_dir=True)
    fs, _ = fsspec.core.url_to_fs(location)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    made = []
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args: object, **kwargs: object) -> tuple[int, str]:
        made.append(real_mkstemp(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    def throttled(*args: object, **kwargs: object) -> bytes:
        raise OSError(5, "SlowDown: Please reduce your request rate")

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(type(fs), "cat_file", throttled)
    with pytest.raises(CheckpointError, match=r"^manifest.json unreadable \(SlowDown: Please reduce your request "
                                              r"rate\); the checkpoint is not skipped for an older one"):
        manager.load("latest")
    monkeypatch.undo()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    reads = []

    def throttled_state_file(self: object, path: str, start: object = None, end: object = None,
                             **kwargs: object) -> bytes:
        reads.append(path)
        if path.endswith("/state.pt") and len([read for read in reads if read.endswith("/state.pt")]) == 1:
            raise OSError(5, "SlowDown: Please reduce your request rate")
        return real_cat(self, path, start, end, **kwargs)

    real_cat = type(fs).cat_file
    monkeypatch.setattr(type(fs), "cat_file", throttled_state_file)
    with pytest.raises(CheckpointError, match=r"^state.pt unreadable \(SlowDown"):
        manager.load("latest")
    assert made and all(path.startswith(str(tmp_path / f"ddp-deploy-{os.getuid()}") + "/")
                        for _, path in made), made


def test_on_an_object_store_a_leftover_the_client_cannot_remove_is_named_in_a_warning(manager_for, monkeypatch,
                                                                                      caplog):
    location = f"memory://ckpt-{uuid.uuid4().hex}"
    save_steps(manager_for(location), [1])
    late = open_storage(location)
    unfinished = late.begin("step-00000002", generation=0)
    late.write_file(unfinished, "state.pt", lambda handle: handle.write(b"half"))
    fs, _ = fsspec.core.url_to_fs(location)

    class ClientError(Exception):  # as botocore's: no OSError
        pass

    removing = type(fs).rm

    def refused(self: object, path: str, *args: object, **kwargs: object) -> None:
        if unfinished in path:
            raise ClientError("AccessDenied")
        removing(self, path, *args, **kwargs)

    monkeypatch.setattr(type(fs), "rm", refused)
    manager_for(location, take_over_checkpoint_dir=True)
    warned = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert any(line.endswith(f"/{unfinished}, left by a save that did not finish: ClientError: AccessDenied")
               and line.startswith("could not remove memory://") for line in warned), warned


# -- retention -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep_last", [2, 3])
def test_keep_last_keeps_the_newest_k(keep_last, manager_for, tmp_path):
    save_steps(manager_for(str(tmp_path), keep_last=keep_last), [1, 2, 3, 4, 5, 6])
    assert names(str(tmp_path)) == [f"step-{step:08d}" for step in range(6, 6 - keep_last, -1)]


def test_keep_best_also_keeps_the_most_accurate_one(manager_for, tmp_path):
    manager = manager_for(str(tmp_path), keep_last=2, keep_best=True)
    save_steps(manager, [1, 2, 3, 4, 5], accuracy={1: 0.5, 2: 0.9, 3: 0.7, 4: 0.6, 5: 0.8})
    assert names(str(tmp_path)) == ["step-00000005", "step-00000004", "step-00000002"]


def test_pruning_keeps_the_newest_even_when_the_best_is_older(manager_for, tmp_path):
    manager = manager_for(str(tmp_path), keep_last=2, keep_best=True)
    save_steps(manager, [1, 2, 3], accuracy={1: 0.99, 2: 0.1, 3: 0.2})
    assert names(str(tmp_path)) == ["step-00000003", "step-00000002", "step-00000001"]


def test_broken_later_checkpoints_do_not_count_against_the_good_ones(manager_for, tmp_path):
    """After resuming past broken newer checkpoints, this run keeps keep_last good fallbacks of its own."""
    save_steps(manager_for(str(tmp_path)), [1, 2, 3])
    break_checkpoint(tmp_path / "step-00000003", "flipped-bytes")
    break_checkpoint(tmp_path / "step-00000002", "flipped-bytes")
    manager = manager_for(str(tmp_path), keep_last=2)
    assert manager.load("latest").location.endswith("step-00000001")
    manager.save(state_at(2))
    assert names(str(tmp_path)) == ["step-00000003", "step-00000002", "step-00000001"]
    manager.save(state_at(3))
    assert names(str(tmp_path)) == ["step-00000003", "step-00000002"]
    for name in names(str(tmp_path)):
        verify(open_storage(str(tmp_path)), name)


# -- fsspec URLs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_an_fsspec_url_round_trips_with_retention_and_broken_ones_skipped(scheme, manager_for, tmp_path):
    location = f"memory://ckpt-{uuid.uuid4().hex}" if scheme == "memory" else f"file://{tmp_path}"
    save_steps(manager_for(location, keep_last=2), [1, 2, 3])
    assert steps(location) == [3, 2]
    fs, root = fsspec.core.url_to_fs(location)
    fs.pipe_file(f"{root}/{names(location)[0]}/state.pt", b"not a checkpoint")
    loaded = manager_for(location).load("latest")
    assert loaded is not None and loaded.location.endswith(names(location)[1])
    assert not has_tensors(loaded.state.parts)  # what every rank is sent: each reads the tensors from the file
    assert torch.equal(whole(loaded)["model"]["weight"], state_at(2).model["weight"])
    assert not [path for path in fs.ls(root, detail=False) if "/.tmp-" in path]


def test_an_object_stores_state_file_that_this_machine_cannot_copy_stops_the_resume_never_skips_it(
        manager_for, monkeypatch):
    """The state file is downloaded to a local temporary file and mapped: a full or missing TMPDIR is this
    machine's fault, and skipping the checkpoint for it would start afresh and later prune the good ones."""
    location = f"memory://ckpt-{uuid.uuid4().hex}"
    save_steps(manager_for(location), [1])
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/ddp-deploy-tmp")
    with pytest.raises(CheckpointError, match=r"^cannot copy the checkpoint's state.pt to a local temporary file in "
                                              r"/nonexistent/ddp-deploy-tmp \(No such file or directory\); point "
                                              r"TMPDIR at a folder with room for it$"):
        manager_for(location).load("latest")


# -- asynchronous saving -------------------------------------------------------------------------------------

def test_async_save_writes_the_state_as_it_was_when_save_returned(manager_for, tmp_path):
    manager = manager_for(str(tmp_path), async_checkpoint=True)
    weight = torch.zeros(256, 256)
    manager.save(state_at(1, weight))
    weight.add_(1.0)  # training goes on while the background thread writes
    manager.finish()
    assert torch.equal(verify(open_storage(str(tmp_path)), "step-00000001").state.model["weight"],
                       torch.zeros(256, 256))
    assert manager.last_timing.bytes > 0 and manager.last_timing.write_s > 0


def test_a_failed_background_write_is_raised_by_finish_and_leaves_good_checkpoints_alone(manager_for, tmp_path):
    folder = tmp_path / "ckpt"
    manager = manager_for(str(folder), async_checkpoint=True)
    save_steps(manager, [1])
    # The folder goes away and a file takes its place: the next write cannot create its temporary folder.
    folder.rename(tmp_path / "moved")
    folder.write_bytes(b"")
    good = checkpoint_bytes(tmp_path / "moved")
    manager.save(state_at(2))
    with pytest.raises(CheckpointError, match="could not write checkpoint .*step-00000002: Not a directory"):
        manager.finish()
    assert checkpoint_bytes(tmp_path / "moved") == good


def test_manifest_is_plain_json(manager_for, tmp_path):
    save_steps(manager_for(str(tmp_path)), [1])
    manifest = json.loads((tmp_path / "step-00000001" / "manifest.json").read_text())
    assert manifest["format"] == 3 and set(manifest["files"]["state.pt"]) == {"bytes", "crc32"}
    assert (manifest["step"], manifest["task"], manifest["world_size"]) == (1, "test", 1)


def test_async_save_copies_the_parameters_in_the_background_and_before_update_waits_for_that_copy(
        manager_for, tmp_path):
    manager = manager_for(str(tmp_path), async_checkpoint=True)
    weight, running_mean = torch.zeros(512, 512), torch.zeros(8)
    state = state_at(1, weight)
    state.model["running_mean"] = running_mean
    manager.save(state, changed_by_step_only=lambda path: path == "/model/weight")
    running_mean.add_(1.0)  # a buffer: the next forward pass changes it, so save() had copied it already
    manager.before_update()
    weight.add_(1.0)  # the optimizer step, once before_update() returned
    manager.finish()
    saved = verify(open_storage(str(tmp_path)), "step-00000001").state.model
    assert torch.equal(saved["weight"], torch.zeros(512, 512))
    assert torch.equal(saved["running_mean"], torch.zeros(8))
    assert manager.last_timing.copied_later_bytes == weight.nbytes  # the weight's copy was the thread's




@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_write_to_a_store_that_stops_answering_ends_within_the_deadline_as_retryable(manager_for, s3_env,
                                                                                          asynchronous):
    """A real S3 server, frozen (SIGSTOP) after the first save: the second save (or, asynchronous, the wait
    for it) gives up after --checkpoint-timeout-s with StorageStalled (exit 200), and closing does not wait."""
    location = f"s3://{s3_env.new_bucket()}/ckpt"
    manager = manager_for(location, checkpoint_timeout_s=2, async_checkpoint=asynchronous)
    save_steps(manager, [1])
    with s3_env.stopped():
        started = time.monotonic()
        with pytest.raises(StorageStalled) as stalled:
            manager.save(state_at(2))
            manager.finish()
        manager.close()
        took = time.monotonic() - started
    assert StorageStalled.exit_code == EXIT_PEER_LOST and 2 <= took < 2 + RELEASE_AFTER_STALL_S + 3, took
    assert f"checkpoint {location}/step-00000002 was not written within 2s (--checkpoint-timeout-s)" in str(
        stalled.value)
    storage = open_storage(location)  # the given-up write may be uploading into its own folder again by now
    assert [step_of(name) for name in names(location) if storage.exists(name, "manifest.json")] == [1]
    # The server answers again and the given-up write goes on: it must neither commit nor leave a folder behind.
    manager.writer.thread.join(60)
    assert not manager.writer.thread.is_alive()
    assert steps(location) == [1] and open_storage(location).remove_temporaries() == []


def test_the_checkpoint_sent_to_trackers_is_this_runs_last_and_its_lookup_never_holds_or_fails_the_end(
        manager_for, tmp_path, monkeypatch, caplog):
    from trainer.api import checkpoint_written

    manager = manager_for(str(tmp_path))
    assert checkpoint_written(manager, logging.getLogger("checkpoint-test")) is None  # nothing committed yet
    save_steps(manager, [1, 2])
    # A later checkpoint this run did not write (another branch's, after --resume PATH): not this run's to send.
    shutil.copytree(tmp_path / "step-00000002", tmp_path / "step-00000009")
    assert open_storage(str(tmp_path)).list_checkpoints()[0] == "step-00000009"
    found = checkpoint_written(manager, logging.getLogger("checkpoint-test"))
    assert found is not None and found.name == "step-00000002" and "manifest.json" in found.files

    def broken(name: str) -> list[str]:
        raise RuntimeError("An error occurred (AccessDenied) when calling the ListObjectsV2 operation")

    monkeypatch.setattr(manager.storage, "files", broken)
    assert checkpoint_written(manager, logging.getLogger("checkpoint-test")) is None
    assert "AccessDenied" in caplog.text and "the trackers get no checkpoint" in caplog.text
    release = threading.Event()
    monkeypatch.setattr(manager.storage, "files", lambda name: release.wait(60) and [])
    started = time.monotonic()
    assert checkpoint_written(manager, logging.getLogger("checkpoint-test"), within_s=0.5) is None
    assert time.monotonic() - started < 5 and "took more than 0.5s" in caplog.text
    release.set()


def save_held_midway(manager: CheckpointManager, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An asynchronous save of step 1 whose writer stops inside its state file (a hung disk, a partitioned node)
    until the returned event is set; returns once the writer is there."""
    from trainer.checkpoint import writer as writer_module

    writing, go_on = threading.Event(), threading.Event()
    save_state = writer_module.save_state

    def held(state: dict, handle: object) -> None:
        writing.set()
        go_on.wait(30)
        save_state(state, handle)

    monkeypatch.setattr(writer_module, "save_state", held)
    manager.save(state_at(1))
    assert writing.wait(30)
    return go_on


def test_a_write_whose_job_lost_the_lease_meanwhile_never_commits(manager_for, tmp_path, monkeypatch):
    """A replacement takes the lease while this rank 0's write is under way (--take-over-checkpoint-dir, or a
    partitioned node, a stalled disk): the lease is checked again at the commit itself, so the old write neither
    commits nor moves the new job's same-step folder aside."""
    from trainer.checkpoint.lease import CheckpointLease

    manager = manager_for(str(tmp_path), async_checkpoint=True)
    go_on = save_held_midway(manager, monkeypatch)
    assert manager.lease is not None
    replacement = CheckpointLease(open_storage(str(tmp_path)), manager.lease.job, "other-host", 60.0,
                                  logging.getLogger("checkpoint-test"), job_named=True)
    replacement.take(take_over=True)  # a live holder is only ever taken from explicitly (or once it stalled)
    go_on.set()
    with pytest.raises(CheckpointError, match="was taken over by job .* with --take-over-checkpoint-dir"):
        manager.finish()
    assert names(str(tmp_path)) == [] and open_storage(str(tmp_path)).remove_temporaries() == []
    replacement.release()


def test_closing_returns_when_the_storage_hangs_at_the_end_and_the_lease_is_left_to_expire(manager_for, tmp_path,
                                                                                          monkeypatch):
    """A mount that stops answering after the last checkpoint must not keep a finished job alive: the lease's
    renewal and release are given a bounded time, then the lease expires by itself."""
    from trainer.checkpoint import lease as lease_module
    from trainer.checkpoint import manager as manager_module

    monkeypatch.setattr(manager_module, "RELEASE_S", 0.5)
    monkeypatch.setattr(lease_module, "RENEWER_JOIN_S", 0.2)
    manager = manager_for(str(tmp_path), lease_expiry_s=4)
    save_steps(manager, [1])
    hung, stuck = threading.Event(), threading.Event()
    assert manager.lease is not None
    monkeypatch.setattr(manager.lease.storage, "replace_file", lambda *args: stuck.set() or hung.wait(60))
    assert stuck.wait(10)  # a renewal (every second here) is now stuck in the hung storage
    started = time.monotonic()
    manager.close()
    assert time.monotonic() - started < 3
    hung.set()


def test_closing_with_an_async_write_still_running_waits_only_until_its_deadline_and_it_never_commits(
        manager_for, tmp_path, monkeypatch):
    manager = manager_for(str(tmp_path), async_checkpoint=True, checkpoint_timeout_s=1)
    go_on = save_held_midway(manager, monkeypatch)
    started = time.monotonic()
    manager.close()  # no finish(): the end of a run whose last save is still being written
    assert time.monotonic() - started < 1 + RELEASE_AFTER_STALL_S + 2
    go_on.set()  # the storage answers again
    manager.writer.thread.join(30)
    assert names(str(tmp_path)) == [] and open_storage(str(tmp_path)).remove_temporaries() == []


def test_a_run_stopped_before_its_end_keeps_the_lease_for_the_next_attempt_when_its_launcher_restarts_it(
        runtime, log, tmp_path, caplog):
    """Between two attempts of a job whose launcher restarts its workers (torchrun: a membership change, a lost
    peer) no other job takes the folder. Released: at the end, after the last restart's failure, or where no
    launcher restarts in place. Kept, the lease is no longer renewed (it expires as a killed job's does)."""
    from dataclasses import replace

    from trainer.checkpoint.manager import FAILED, FINISHED, STOPPED

    def manager(job: str, restarts_left: int | None) -> CheckpointManager:
        identity = replace(runtime.identity, job=job, job_named=True, restarts_left=restarts_left)
        made = CheckpointManager(CheckpointConfig(), str(tmp_path), replace(runtime, identity=identity), log,
                                 Monitor("accuracy", "max"))
        made.prepare()
        return made

    def refused(job: str) -> bool:
        try:
            manager(job, None).close(FAILED)
        except CheckpointError as error:
            assert "is kept by job elastic (on " in str(error) and "for its next attempt" in str(error), str(error)
            return True
        return False

    for ending, left in ((STOPPED, 0), (FAILED, 2)):  # a signal (membership change), a failure with restarts left
        held = manager("elastic", restarts_left=left)
        lease = held.lease
        held.close(ending)
        assert lease is not None and lease._renewer is not None and not lease._renewer.is_alive(), "renewals stop"
        assert "keeping the lease of checkpoint folder" in caplog.text
        assert refused("another")
        caplog.clear()
        manager("elastic", restarts_left=left).close(FINISHED)  # the next attempt takes it at once, to the end
        assert "took the lease of checkpoint folder" in caplog.text and "took over" not in caplog.text
        assert not refused("another")  # released at the end: no wait
    manager("elastic", restarts_left=0).close(FAILED)  # the last attempt failed: nobody restarts it
    assert not refused("another")
    manager("another", restarts_left=None).close(STOPPED)  # no launcher restarts it in place
    assert not refused("third")


# -- a launcher told of each commit (trainer.on_ray reports them to Ray Train) --------------------------------

@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_on_commit_hears_of_each_save_once_every_rank_knows_it_committed_with_where_it_is(async_checkpoint,
                                                                                           manager_for, tmp_path):
    manager = manager_for(str(tmp_path), async_checkpoint=async_checkpoint)
    heard: list[tuple[int, str | None, dict[str, float]]] = []
    created: dict[int, float | None] = {}

    def told(committed: Committed) -> None:
        heard.append((committed.step, committed.location, committed.metrics))
        created[committed.step] = committed.created_unix

    manager.on_commit = told
    manager.save(state_at(1))
    # Asynchronous: the write may still be running, so nothing is told until the next save or finish collects it.
    assert heard == ([] if async_checkpoint else [(1, f"{tmp_path}/step-00000001", {})])
    manager.save(state_at(2), {"accuracy": 0.5})
    assert [step for step, _, _ in heard] == ([1] if async_checkpoint else [1, 2])
    manager.finish()
    manager.finish()  # told once
    assert heard == [(1, f"{tmp_path}/step-00000001", {}), (2, f"{tmp_path}/step-00000002", {"accuracy": 0.5})]
    # When each was committed, not when every rank learnt of it (an asynchronous save's, at the next save).
    assert created == {step: json.loads((tmp_path / f"step-0000000{step}" / "manifest.json").read_text())
                       ["created_unix"] for step in (1, 2)}


def test_on_commit_hears_nothing_of_a_save_that_failed(manager_for, tmp_path):
    folder = tmp_path / "ckpt"
    manager = manager_for(str(folder), async_checkpoint=True)
    heard: list[int] = []
    manager.on_commit = lambda committed: heard.append(committed.step)
    save_steps(manager, [1])
    folder.rename(tmp_path / "moved")
    folder.write_bytes(b"")  # the next write cannot create its temporary folder
    manager.save(state_at(2))
    with pytest.raises(CheckpointError):
        manager.finish()
    assert heard == [1]
