"""ddp-train-ray's bad inputs that need no Ray cluster: each one line, before anything starts (the cluster's own
ones, and the runs on a real cluster, are in tests/deploy/test_ray.py)."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys

import pytest

from devtools.processes import clean_env, free_port
from tests.integration.test_resize import LEDGER
from trainer.on_ray import (
    RAY_MISSING,
    RayRun,
    _check_reachable,
    _gave_up,
    _has_committed,
    _newest,
    driving,
    main,
    pointed_at,
    run_on_ray,
    write_pointer,
)


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that got past its checks would start a local Ray cluster (ray.init): here it stops at the address."""
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")


def errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


UNREACHABLE = ("error: cannot reach the Ray cluster at 127.0.0.1:{port} (Connection refused); start one with "
               "`ray start --head`, or pass its GCS address as --ray-address HOST:PORT")
OBJECT_STORE = ("error: --ray-storage-path s3://bucket/runs: Ray's run folder must be a folder every worker mounts "
                "(NFS, a shared volume) under ddp-train-ray; the checkpoints themselves may go to an object store "
                "(--checkpoint-dir s3://...)")


@pytest.mark.parametrize(("ray_run", "message"), [(RayRun(address="127.0.0.1:{port}"), UNREACHABLE),
                                                  (RayRun(storage_path="s3://bucket/runs"), OBJECT_STORE)])
def test_a_cluster_that_does_not_answer_or_an_object_store_run_folder_is_one_line(ray_run, message, tmp_path, capsys):
    port = free_port()
    if ray_run.address:
        ray_run = RayRun(address=ray_run.address.format(port=port), storage_path=str(tmp_path))
    assert run_on_ray(None, LEDGER, ray_run) == 2
    assert errors(capsys) == [message.format(port=port)]


def test_without_ray_installed_the_run_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert run_on_ray(None, LEDGER, RayRun(storage_path=str(tmp_path))) == 2
    assert errors(capsys) == [f"error: {RAY_MISSING}"]


def test_the_trainers_flags_are_checked_on_the_driver_before_ray_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--ray-storage-path", str(tmp_path), *LEDGER, "--epochs", "many"])
    assert exited.value.code == 2 and "argument --epochs: invalid int value: 'many'" in capsys.readouterr().err


@pytest.mark.parametrize(("option", "value"), [("--ray-workers", "0"), ("--ray-workers", "3:2"),
                                               ("--ray-workers", "two"), ("--ray-workers", "1:"),
                                               ("--ray-cpus-per-worker", "nan"), ("--ray-cpus-per-worker", "-1"),
                                               ("--ray-resize-check-s", "0")])
def test_a_bad_worker_count_or_size_is_refused(option, value, capsys):
    with pytest.raises(SystemExit) as exited:
        main([option, value])
    assert exited.value.code == 2 and f"argument {option}" in capsys.readouterr().err


def test_the_trainers_own_flags_of_the_same_words_pass_through_to_it(monkeypatch):
    """ddp-train's --num-workers (DataLoader workers) and --run-name (the tracker's run) are the trainer's."""
    seen = {}
    monkeypatch.setattr("trainer.on_ray.run_on_ray", lambda task, argv, ray_run: seen.update(argv=argv, run=ray_run))
    main(["--ray-workers", "2:3", "--num-workers", "0", "--run-name", "nightly", "--ray-run-name", "fmnist"])
    assert seen["argv"] == ["--num-workers", "0", "--run-name", "nightly"]
    assert (seen["run"].num_workers, seen["run"].name) == ((2, 3), "fmnist")


@pytest.mark.parametrize("name", ["team/fmnist", "", ".", "..", "../x"])
def test_a_run_name_that_is_not_one_plain_folder_name_is_refused(name, tmp_path, capsys):
    """Ray's run folder would not be the trainer's, and every report of a checkpoint would fail."""
    assert run_on_ray(None, LEDGER, RayRun(name=name, storage_path=str(tmp_path))) == 2
    assert errors(capsys) == [f"error: --ray-run-name {name!r}: a run's name is one folder name (no '/', not '.' or "
                              f"'..'), its folder STORAGE_PATH/NAME; put any hierarchy in --ray-storage-path"]


def test_an_elastic_run_whose_global_batch_some_worker_count_does_not_divide_is_refused(tmp_path, capsys):
    ray_run = RayRun(num_workers=(2, 4), storage_path=str(tmp_path))
    assert run_on_ray(None, [*LEDGER, "--global-batch-size", "256"], ray_run) == 2
    assert errors(capsys) == ["error: --global-batch-size 256 does not divide into 3 worker(s) x 1 micro-batch(es), "
                              "and Ray may run it at any of 2:4 workers; give a multiple of 12"]


def test_a_second_driver_of_a_running_run_is_refused_and_a_dead_drivers_run_is_free(tmp_path, capsys):
    """Two drivers of one run would be one job to the checkpoint lease, and take the checkpoints from each other."""
    folder = tmp_path / "fmnist"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_RUN, str(folder)], stdout=subprocess.PIPE, text=True,
                              env=clean_env())
    try:
        assert holder.stdout.readline().strip() == "holding"
        assert run_on_ray(None, LEDGER, RayRun(name="fmnist", storage_path=str(tmp_path))) == 2
        (line,) = errors(capsys)
        assert line == (f"error: run {folder} already has a driver (ddp-train-ray pid {holder.pid} on "
                        f"{socket.gethostname()}): two drivers of one run would take its checkpoints from each other; "
                        f"stop that one, or choose another --ray-run-name")
    finally:
        holder.kill()
        holder.wait()
    with driving(folder):  # the dead driver's hold went with it
        pass


HOLD_THE_RUN = """
import sys, time
from pathlib import Path
from trainer.on_ray import driving
with driving(Path(sys.argv[1])):
    print("holding", flush=True)
    time.sleep(60)
"""


def test_each_report_gets_a_pointer_of_its_own_naming_the_trainers_checkpoint(tmp_path):
    """Two reports of one step (an epoch-end save replacing a --checkpoint-every one): Ray deletes the older's
    folder as it registers the newer, which must not be the same folder."""
    first = write_pointer(tmp_path, "/runs/r/checkpoints/step-00000008", 8)
    second = write_pointer(tmp_path, "/runs/r/checkpoints/step-00000008", 8)
    assert first != second and first.parent == second.parent == tmp_path / "ray-checkpoints"
    assert pointed_at(first) == pointed_at(second) == "/runs/r/checkpoints/step-00000008"


@pytest.mark.parametrize("address", ["auto", "local", "", "http://10.255.255.1:8265", "ray-head:6379x"])
def test_addresses_ray_resolves_itself_are_left_to_it(address):
    """A RayJob's entrypoint may see a dashboard's http:// address; only HOST:PORT and ray://HOST:PORT are tried."""
    _check_reachable(address)  # no connection attempted: nothing to refuse


class FakeWorkerGroupError(Exception):
    """Ray's WorkerGroupError as the driver reads it: each worker's failure of the last attempt."""

    __module__ = "ray.train.v2.api.exceptions"

    def __init__(self, failures: dict[int, Exception]) -> None:
        super().__init__("Training failed due to worker errors")
        self.worker_failures = failures


@pytest.mark.parametrize(("codes", "exit_code"), [((2, 2), 2), ((2, 200), 200), ((2, None), 200), ((), 200)])
def test_when_ray_gives_up_the_exit_says_whether_the_input_is_to_fix(codes, exit_code, capsys):
    """Exit 2 (do not retry) only where every worker's trainer refused its input; a worker lost otherwise is not."""
    failures = {rank: RuntimeError(f"the trainer exited with {code} on rank {rank}" if code else "actor died")
                for rank, code in enumerate(codes)}
    assert _gave_up(FakeWorkerGroupError(failures), RayRun(storage_path="/runs")) == exit_code
    (line,) = errors(capsys)
    assert ("refused its input on every worker" in line) == (exit_code == 2), line


def test_the_python_forms_run_is_checked_as_the_command_lines(tmp_path, capsys):
    for ray_run, message in [(RayRun(num_workers=(0, 0)), "num_workers (0, 0): need 1 <= MIN <= MAX"),
                             (RayRun(num_workers=(3, 2)), "num_workers (3, 2): need 1 <= MIN <= MAX"),
                             (RayRun(cpus_per_worker=float("nan")), "cpus_per_worker nan: need a number above 0"),
                             (RayRun(max_failures=-2), "max_failures -2: need -1 (no limit) or more")]:
        assert run_on_ray(None, LEDGER, ray_run) == 2
        assert errors(capsys) == [f"error: RayRun {message}"]


def test_a_folder_without_locks_warns_and_runs(tmp_path, monkeypatch, capsys):
    """NFS mounted without locking: every lock attempt fails with ENOLCK, which is no other driver's."""
    def no_locks(*args: object) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr("trainer.on_ray.fcntl.lockf", no_locks)
    with driving(tmp_path / "run"):
        pass
    assert "warning: cannot lock" in capsys.readouterr().err


def test_only_a_committed_checkpoint_makes_a_restart_resume_latest(tmp_path):
    """A first save killed before its manifest leaves a folder the trainer removes: the user's --resume stands."""
    (tmp_path / "step-00000008").mkdir()
    (tmp_path / "step-00000008" / "state.pt").write_bytes(b"partial")
    assert not _has_committed(str(tmp_path))
    (tmp_path / "step-00000008" / "manifest.json").write_text("{}")
    assert _has_committed(str(tmp_path))


def test_the_last_line_names_what_ray_reported_where_the_driver_cannot_list_the_checkpoints(tmp_path):
    pointer = write_pointer(tmp_path, "memory://user:secret@bucket/c/step-00000004", 4)
    result = type("Result", (), {"checkpoint": type("Checkpoint", (), {"path": str(pointer)})()})()
    line = _newest("nosuchscheme://user:secret@bucket/c", result)
    assert line == "Ray's last report named checkpoint memory://user:***@bucket/c/step-00000004", line
