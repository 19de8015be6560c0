"""ddp-train-ray's bad inputs that need no Ray cluster: each one line, before anything starts (the cluster's own
ones, and the runs on a real cluster, are in tests/deploy/test_ray.py)."""

from __future__ import annotations

import sys

import pytest

from devtools.processes import free_port
from tests.integration.test_resize import LEDGER
from trainer.on_ray import RAY_MISSING, RayRun, _check_reachable, main, pointed_at, run_on_ray, write_pointer


def errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


UNREACHABLE = ("error: cannot reach the Ray cluster at 127.0.0.1:{port} (Connection refused); start one with "
               "`ray start --head`, or pass its GCS address as --ray-address HOST:PORT")
OBJECT_STORE = ("error: --storage-path s3://bucket/runs: Ray's run folder must be a folder every worker mounts (NFS, a "
                "shared volume) under ddp-train-ray; the checkpoints themselves may go to an object store "
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
        main(["--storage-path", str(tmp_path), *LEDGER, "--epochs", "many"])
    assert exited.value.code == 2 and "argument --epochs: invalid int value: 'many'" in capsys.readouterr().err


@pytest.mark.parametrize("workers", ["0", "3:2", "two", "1:"])
def test_a_worker_count_that_is_not_n_or_min_max_is_refused(workers, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--num-workers", workers])
    assert exited.value.code == 2 and "argument --num-workers" in capsys.readouterr().err


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
