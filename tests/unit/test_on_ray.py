"""ddp-train-ray's bad inputs that need no Ray cluster: each one line, before anything starts (the cluster's own
ones, and the runs on a real cluster, are in tests/deploy/test_ray.py)."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from devtools.processes import REPO_ROOT, clean_env, free_port
from tests.integration.test_resize import LEDGER
from trainer.on_ray import RayRun, main, run_on_ray
from trainer.on_ray.cluster import RAY_MISSING, check_reachable
from trainer.on_ray.driver import _gave_up, _newest
from trainer.on_ray.driver_lock import driving, locks_only_locally, mount_of
from trainer.on_ray.paths import as_workers_read_them
from trainer.on_ray.pointers import pointed_at, write_pointer
from trainer.on_ray.ray_internals import SUPPORTED_RAY, check_ray_version
from trainer.on_ray.settings import RayLaunchError
from trainer.on_ray.shared_storage import MARKER, NotShared, check_this_node, markers
from trainer.on_ray.worker import has_committed


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
    monkeypatch.setattr("trainer.on_ray.cli.run_on_ray",
                        lambda task, argv, ray_run: seen.update(argv=argv, run=ray_run))
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
from trainer.on_ray.driver_lock import driving
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
    check_reachable(address)  # no connection attempted: nothing to refuse


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

    monkeypatch.setattr("trainer.on_ray.driver_lock.fcntl.lockf", no_locks)
    with driving(tmp_path / "run"):
        pass
    assert "warning: cannot lock" in capsys.readouterr().err


def test_only_a_committed_checkpoint_makes_a_restart_resume_latest(tmp_path):
    """A first save killed before its manifest leaves a folder the trainer removes: the user's --resume stands."""
    (tmp_path / "step-00000008").mkdir()
    (tmp_path / "step-00000008" / "state.pt").write_bytes(b"partial")
    assert not has_committed(str(tmp_path))
    (tmp_path / "step-00000008" / "manifest.json").write_text("{}")
    assert has_committed(str(tmp_path))


def test_the_last_line_names_what_ray_reported_where_the_driver_cannot_list_the_checkpoints(tmp_path):
    pointer = write_pointer(tmp_path, "memory://user:secret@bucket/c/step-00000004", 4)
    result = type("Result", (), {"checkpoint": type("Checkpoint", (), {"path": str(pointer)})()})()
    line = _newest("nosuchscheme://user:secret@bucket/c", result)
    assert line == "Ray's last report named checkpoint memory://user:***@bucket/c/step-00000004", line


# -- the trainer's path flags as the workers read them (trainer/on_ray/paths.py) -----------------------------------
def test_relative_path_flags_become_the_drivers_absolute_paths_without_a_job_working_dir():
    argv = ["--config", "cfg.yaml", "--data-dir=data/fmnist", "--checkpoint-dir", "ckpt", "--resume", "latest",
            "--init-from", "/abs/init", "--output-dir", "s3://bucket/out", "--epochs", "2", "--data-cache-dir", "c"]
    assert as_workers_read_them(argv, "/home/me/proj", job_working_dir=False) == [
        "--config", "/home/me/proj/cfg.yaml", "--data-dir=/home/me/proj/data/fmnist", "--checkpoint-dir",
        "/home/me/proj/ckpt", "--resume", "latest", "--init-from", "/abs/init", "--output-dir", "s3://bucket/out",
        "--epochs", "2", "--data-cache-dir", "c"]
    assert as_workers_read_them(["--resume", "runs/x/step-00000004"], "/p", False) == [
        "--resume", "/p/runs/x/step-00000004"]
    home = str(Path.home())
    assert as_workers_read_them(["--checkpoint-dir=~/ck", "--config", "~/c.yaml"], "/p", True) == [
        f"--checkpoint-dir={home}/ck", "--config", f"{home}/c.yaml"]


def test_in_a_job_working_dir_inputs_stay_relative_and_a_relative_output_is_refused():
    """Each node unpacks the job's --working-dir for itself: inputs mean the same files there, outputs do not."""
    argv = ["--config", "cfg.yaml", "--data-dir", "data", "--checkpoint-dir", "/shared/ckpt"]
    assert as_workers_read_them(argv, "/tmp/ray/session/_ray_pkg_1", job_working_dir=True) == argv
    for flag in ("--checkpoint-dir", "--output-dir"):
        with pytest.raises(RayLaunchError, match=f"^{flag} ckpt: a relative path is inside the job's --working-dir"):
            as_workers_read_them([flag, "ckpt"], "/tmp/ray/session/_ray_pkg_1", job_working_dir=True)


# -- a run name that cannot resume a stranger -----------------------------------------------------------------------
def test_each_run_gets_a_name_of_its_own_unless_given_one(monkeypatch):
    assert RayRun().name != RayRun().name and RayRun().name.startswith("ddp-train-")
    seen = []
    monkeypatch.setattr("trainer.on_ray.cli.run_on_ray", lambda task, argv, ray_run: seen.append(ray_run.name))
    main([])
    main([])
    main(["--ray-run-name", "nightly"])
    assert seen[0] != seen[1] and seen[2] == "nightly"


@pytest.mark.parametrize("resume", ["none", "/elsewhere/step-00000002"])
def test_a_resume_that_would_not_go_on_with_a_runs_own_checkpoints_is_refused(resume, tmp_path, capsys):
    """The workers resume a run that has checkpoints from its newest: a --resume saying otherwise is refused, not
    overridden (before: silently overridden, and a finished run's second start trained nothing)."""
    committed = tmp_path / "fmnist" / "checkpoints" / "step-00000008"
    committed.mkdir(parents=True)
    (committed / "manifest.json").write_text("{}")
    assert run_on_ray(None, [*LEDGER, "--resume", resume], RayRun(name="fmnist", storage_path=str(tmp_path))) == 2
    assert errors(capsys) == [f"error: --resume {resume}: run fmnist already has checkpoints in "
                              f"{tmp_path / 'fmnist' / 'checkpoints'}, and a run goes on from its own; for a new run "
                              f"give a new --ray-run-name (or none: each run gets its own), or drop --resume to go on"]


# -- the Ray releases it runs on --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("version", "supported"), [("2.57.2", False), ("2.58.0", True), ("2.59.1", True),
                                                    ("2.60.0", True), ("2.61.0", False), ("3.0.0.dev0", False)])
def test_a_ray_release_outside_the_tested_range_is_named_with_the_install_line(version, supported):
    problem = check_ray_version(version)
    assert (problem is None) == supported
    if not supported:
        assert problem == (f"Ray {version} is not one ddp-train-ray is tested on (>= 2.58.0, < 2.61): pip install "
                           f"'ray[default,train]>=2.58.0,<2.61' at the version of your cluster")


def test_the_ray_extra_is_the_tested_range_with_rays_job_server():
    """`ray job submit` and a KubeRay RayJob need the dashboard's job server: ray[default], not ray[train] alone."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    (extra,) = project["optional-dependencies"]["ray"]
    low, high = SUPPORTED_RAY
    assert extra == f"ray[default,train]>={low},<{high}"
    pinned = [item for item in project["optional-dependencies"]["dev"] if item.startswith("ray[")]
    assert len(pinned) == 1 and pinned[0].startswith("ray[default,train]==")


# -- the driver's lock where the folder's locks are the machine's alone ------------------------------------------------
MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:50 / /shared rw,relatime shared:20 - nfs 10.0.0.5:/export rw,vers=3,nolock,addr=10.0.0.5
41 22 0:51 / /shared/locked rw,relatime shared:21 - nfs4 10.0.0.6:/export rw,vers=4.2,addr=10.0.0.6
42 22 0:52 / /local\\040locks rw,relatime shared:22 - nfs 10.0.0.7:/export rw,vers=3,local_lock=posix
"""


def test_an_nfs_mount_whose_locks_are_local_warns_and_the_others_do_not(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(MOUNTINFO)
    cases = {"/shared/runs/r": ("/shared", True), "/shared/locked/runs": ("/shared/locked", False),
             "/local locks/r": ("/local locks", True), "/home/me/r": ("/", False)}
    for path, (point, local) in cases.items():
        mount = mount_of(Path(path), mountinfo)
        assert mount is not None and mount.point == point and locks_only_locally(mount) == local, path
    assert mount_of(Path("/x"), tmp_path / "absent") is None


def test_the_lock_on_a_nolock_mount_warns_in_one_line(tmp_path, capsys):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
                         f"40 22 0:50 / {tmp_path} rw - nfs 10.0.0.5:/export rw,vers=3,nolock\n")
    with driving(tmp_path / "run", mountinfo):
        pass
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {tmp_path / 'run'} is on an NFS mount with nolock ({tmp_path}), where locks are this machine's "
        f"alone: a second driver of this run on another machine would not be refused"]


# -- the shared-folder markers (the nodes' own check: tests/deploy/test_ray.py) ---------------------------------------
def test_a_marker_is_seen_with_its_token_and_removed_after_the_run_and_two_runs_keep_their_own(tmp_path):
    """Two runs sharing a checkpoint folder: the second's start and end leave the first's marker as it was."""
    run, checkpoints = tmp_path / "run", tmp_path / "ckpt"
    with markers([str(run), str(checkpoints), str(run)]) as first:
        assert first.folders == (str(run), str(checkpoints)) and first.missing_here() is None
        with markers([str(checkpoints)]) as second:
            assert second.missing_here() is None and first.missing_here() is None
        assert first.missing_here() is None, "the second run's end took the first's marker"
        (checkpoints / f"{MARKER}-{first.token}").unlink()
        assert first.missing_here() == str(checkpoints)
        with pytest.raises(NotShared, match=f"does not see {checkpoints} as the driver wrote it"):
            check_this_node(first)
    assert not list(run.glob(f"{MARKER}*")) and not list(checkpoints.glob(f"{MARKER}*"))


@pytest.mark.parametrize("argv", [["--ray-run-name", ""], ["--ray-run-name="]])
def test_an_empty_run_name_on_the_command_line_is_refused_not_replaced(argv, tmp_path, capsys):
    """`--ray-run-name "$RUN"` with RUN unset would otherwise start a new run at every driver restart."""
    assert main([*argv, "--ray-storage-path", str(tmp_path), *LEDGER]) == 2
    assert errors(capsys) == ["error: --ray-run-name '': a run's name is one folder name (no '/', not '.' or '..'), "
                              "its folder STORAGE_PATH/NAME; put any hierarchy in --ray-storage-path"]


def test_a_mount_point_with_escapes_and_non_ascii_letters_is_read_as_the_kernel_wrote_it(tmp_path):
    # The kernel escapes space, tab, newline and backslash in octal, and writes other bytes as they are (UTF-8).
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
                         "40 22 0:50 / /mnt/données\\040x rw - nfs4 10.0.0.5:/e rw,local_lock=posix\n")
    mount = mount_of(Path("/mnt/données x/run"), mountinfo)
    assert mount is not None and mount.point == "/mnt/données x" and locks_only_locally(mount)
