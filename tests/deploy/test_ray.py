"""ddp-train-ray on a real Ray cluster: a head and two worker nodes started with ``ray start`` on loopback
(devtools/ray_cluster.py), one CPU and so one trainer worker each.

One elastic run (1 to 2 workers) lives through what Ray does to a job: a worker process killed mid-epoch (Ray
restarts the group at the same size), a node drained (``ray drain-node``, a spot instance's reclaim: the workers
save at the next step, and Ray goes on with one worker from there, nothing lost), the node back (Ray grows the group
to two), and the driver killed and started again with the same run as a Ray job (``ray job submit --working-dir``,
a relative --config that switches it to fsdp: its workers reshard the ddp checkpoint), so both sync methods train
under Ray. Ray's own data iterator repeats or skips
samples across such restarts; the ledger task counts every sample of the epoch trained exactly once, and the model
ends bitwise equal to the same epoch trained straight through. More workers than the cluster can place get one
line (tests/unit/test_on_ray.py has the bad inputs that need no cluster).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from devtools.processes import clean_env
from devtools.ray_cluster import RayCluster
from tests.integration.test_elastic import checkpoint_folders
from tests.integration.test_resize import LEDGER
from tests.support.checkpoint_reading import summary
from tests.support.ledger_checks import assert_each_sample_trained_once, ledger, segments, trained_straight_through
from trainer.on_ray import RayRun, run_on_ray

pytestmark = pytest.mark.slow

# 64 steps of 12 samples at any worker count: enough for four interruptions, each of which costs Ray a restart of
# its worker group (15-30 s here) and the trainer the steps since its last checkpoint (at most 2). Training goes on
# meanwhile where it can: about 20 steps at one worker while the lost node comes back, and a few more by the
# workers of a killed driver, which Ray ends a moment after it.
SAMPLES, GLOBAL_BATCH = 768, 12
STEPS = SAMPLES // GLOBAL_BATCH
ONE_EPOCH = [*[arg for arg in LEDGER if arg != "--sample-log"], "--train-size", str(SAMPLES), "--global-batch-size",
             str(GLOBAL_BATCH)]
PACED = [*[arg if arg != "tests.support.ledger:LedgerTask" else "tests.support.ledger:PacedLedgerTask"
           for arg in ONE_EPOCH], "--step-delay-s", "0.25", "--checkpoint-every", "2"]
# A worker group Ray starts on a node that just died waits this long to fail (Ray's default, 60 s, would make the
# node-lost restart most of the test's time); then Ray starts the group with the nodes there are. Ray's log
# deduplication off: within its 5 s window it prints a line that came again with "[repeated Nx across cluster]" and
# colour codes appended, which the line-matching below would read as another line (CI saw it once).
DRIVER_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20", "RAY_DEDUP_LOGS": "0"}
# Longer than --grace-period-s (25 s), so the grace period bounds the stop; the node is lost right after the resume.
DRAIN_DEADLINE_S = 60
NEWEST = re.compile(r"Ray run (\S+): newest checkpoint (\S+)")


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with RayCluster(dashboard=True) as started:
        started.add_node("a")
        started.add_node("b")
        yield started


def job_env(cluster: RayCluster) -> dict[str, str]:
    return clean_env({**cluster.env(), "RAY_API_SERVER_ADDRESS": cluster.dashboard_address, **DRIVER_ENV})


class Driver:
    """``ddp-train-ray`` started as a user starts it, its output (the workers' logs too) in a file: from a shell, or
    submitted to the cluster's job server with ``submitted_from`` as the job's --working-dir (``ray job submit``
    streams the job's output, and exits as the job ends: 0 where it succeeded)."""

    def __init__(self, folder: Path, name: str, args: list[str], cluster: RayCluster,
                 submitted_from: Path | None = None) -> None:
        self.log = folder / f"{name}.log"
        command = [sys.executable, "-m", "trainer.on_ray", *args]
        if submitted_from is not None:
            command = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--working-dir", ".", "--",
                       "ddp-train-ray", *args]
        with self.log.open("w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=job_env(cluster),
                                            text=True, start_new_session=True, cwd=submitted_from)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, condition: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self.process.poll() is not None and not condition():
                raise AssertionError(f"the driver ended ({self.process.returncode}) before {what}:\n"
                                     f"{self.text()[-5000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}:\n{self.text()[-5000:]}")
            time.sleep(0.2)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()


def only(pids: list[int]) -> int:
    assert len(pids) == 1, pids
    return pids[0]


def resumed(drivers: list[Driver]) -> list[tuple[int, int]]:
    """(world size, step) of each resume, once each: three raylets on one machine forward each log line thrice."""
    return sorted(set(segments([driver.text() for driver in drivers])), key=lambda segment: segment[1])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    return trained_straight_through(ONE_EPOCH, tmp_path_factory.mktemp("uninterrupted"))


def test_a_run_loses_a_worker_a_drained_node_and_its_driver_then_grows_back_and_trains_every_sample_once(
        tmp_path, cluster, uninterrupted):
    storage, name = tmp_path / "ray", "ledger"
    run = storage / name
    # --resume none on the first start, a new run: each worker group Ray starts once the run has checkpoints
    # resumes the newest all the same. The driver started again goes on with the run's own (it would refuse --resume
    # none: tests/unit/test_on_ray.py), submitted as a Ray job from a folder whose config file, named by a relative
    # path, switches it to fsdp: the workers read it in their node's copy of the job's working dir.
    run_args = ["--ray-storage-path", str(storage), "--ray-run-name", name, "--ray-max-failures", "6", *PACED]
    elastic = ["--ray-workers", "1:2", "--ray-resize-check-s", "2", *run_args, "--resume", "none"]
    fixed_fsdp = ["--ray-workers", "2", *run_args, "--config", "fsdp.yaml"]
    project = tmp_path / "project"
    project.mkdir()
    (project / "fsdp.yaml").write_text("sync: fsdp\n")
    drivers = [Driver(tmp_path, "driver-0", elastic, cluster)]
    restarts: dict[str, float] = {}

    def resumes_after(count: int, world: int) -> Callable[[], bool]:
        return lambda: len(resumed(drivers)) > count and resumed(drivers)[-1][0] == world

    def newest_step() -> int:
        return max(checkpoint_folders(run).values(), default=0)

    def interrupt(what: str, count: int, world: int, action: Callable[[], None]) -> None:
        """After a few more checkpoints: the action, then the wait for the run to resume at ``world`` workers."""
        at = newest_step()
        drivers[-1].wait_for(lambda: newest_step() >= at + 4, f"training to go on before: {what}")
        started = time.monotonic()
        action()
        drivers[-1].wait_for(resumes_after(count, world), f"the run to resume at {world} worker(s) after: {what}")
        restarts[what] = time.monotonic() - started

    def restart_driver() -> None:
        # The driver and its workers killed, the run started again: a fixed size, since Ray's elastic policy keeps
        # a dead driver's reservation of the cluster for 180 s (AUTOSCALING_REQUESTS_EXPIRE_TIME_S), and an elastic
        # run started again meanwhile finds no room for a worker.
        drivers[-1].kill()
        drivers.append(Driver(tmp_path, "driver-1", fixed_fsdp, cluster, submitted_from=project))

    try:
        # A worker process killed: Ray restarts the group, at the same size (both nodes are there).
        interrupt("worker killed", 0, 2, lambda: os.kill(only(cluster.worker_pids("b")), signal.SIGKILL))
        # A node drained with a deadline (a spot instance reclaimed): its worker stops at the next step with a
        # checkpoint, the other at the same step (the trainer's stop vote), and Ray goes on with the one worker it
        # can place (none on a draining node), from that checkpoint: nothing lost. Then the node goes, as at its
        # deadline, and comes back: Ray grows the group again.
        drained = cluster.node_id("b")
        interrupt("node drained", 1, 1, lambda: cluster.drain_node("b", DRAIN_DEADLINE_S))
        cluster.lose_node("b")
        interrupt("node added", 2, 2, lambda: cluster.add_node("b"))
        interrupt("driver started again", 3, 2, restart_driver)
        driver = drivers[-1]
        driver.wait_for(lambda: driver.process.poll() is not None, "the run to end", timeout_s=240)
        assert driver.process.returncode == 0 and "succeeded" in driver.text(), driver.text()[-5000:]
    finally:
        for driver in drivers:
            driver.kill()
    print("restart times:", {what: round(seconds, 1) for what, seconds in restarts.items()})
    history = resumed(drivers)
    assert [world for world, _ in history] == [2, 1, 2, 2], history
    logs = "".join(driver.text() for driver in drivers)
    said = set(re.findall(rf"node {drained} is draining \(deadline in (\d+) s\): stopping at step (\d+) to write a "
                          rf"checkpoint", logs))
    assert len(said) == 1, f"the drained node's worker says why it stops, once:\n{logs[-5000:]}"
    ((deadline_s, stopped_at),) = said
    assert 0 < int(deadline_s) <= DRAIN_DEADLINE_S
    assert set(re.findall(r"another rank received a stop signal: stopping at step (\d+)", logs)) == {stopped_at}
    assert history[1] == (1, int(stopped_at)), f"resumed where the drain stopped it: {history}"
    assert [step for _, step in history] == sorted({step for _, step in history}), "each resumes a newer one"
    assert history[-1][1] < STEPS, "the last restart came before the end of the epoch"
    assert summary(run)["global_step"] == STEPS
    # The last group trained under fsdp: its checkpoints are DCP files, one per worker.
    last = json.loads((run / "checkpoints" / f"step-{STEPS:08d}" / "manifest.json").read_text())
    assert last["format"] == 5 and {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(last["files"]), last
    weights = ledger(run)
    assert_each_sample_trained_once(weights, [GLOBAL_BATCH] * STEPS)
    assert torch.equal(weights, uninterrupted), "bitwise the model of the uninterrupted run at one rank"
    # Ray's newest checkpoint points at the trainer's, reported as it committed.
    (reported,) = set(NEWEST.findall(drivers[-1].text()))
    assert reported == (str(run), str(run / "checkpoints" / f"step-{STEPS:08d}")), reported
    # Every worker group is the run's: none refused by the lease, and a lease left by a killed group is taken as
    # an earlier attempt's of the same job.
    assert "in use by another job" not in logs
    takeovers = set(re.findall(r"took over the lease of checkpoint folder \S+ from (.*)", logs))
    assert all(taken.startswith(f"an earlier attempt of this job (ray-run:{run})") for taken in takeovers), takeovers
    assert "via ray" in logs


def test_more_workers_than_the_cluster_can_place_are_refused_in_one_line(tmp_path, cluster, monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    code = run_on_ray(None, ONE_EPOCH, RayRun(num_workers=(3, 3), storage_path=str(tmp_path)))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and errors == ["error: --ray-workers 3: the Ray cluster has room for 2 worker(s) of 1 CPU each; "
                                    "add nodes, lower --ray-workers or --ray-cpus-per-worker, or pass "
                                    "--ray-cluster-autoscales if its autoscaler adds nodes"], errors


# Eight steps; the config file, named by a relative path that each node's copy of the job's working dir has, gives
# the checkpoints' interval (the workers were moved elsewhere before, and failed on it: "--config cfg.yaml: no such
# file"). The driver started again as a job, resuming, is in the test above.
SUBMITTED = [*ONE_EPOCH[:ONE_EPOCH.index("--train-size")], "--train-size", "96", "--global-batch-size", "12",
             "--config", "cfg.yaml"]


def test_ray_job_submit_with_a_working_dir_and_a_relative_config_trains(tmp_path, cluster):
    project, storage = tmp_path / "project", tmp_path / "runs"
    project.mkdir()
    (project / "cfg.yaml").write_text("checkpoint_every: 4\n")
    driver = Driver(tmp_path, "job", ["--ray-workers", "2", "--ray-storage-path", str(storage), "--ray-run-name",
                                      "submitted", *SUBMITTED], cluster, submitted_from=project)
    driver.wait_for(lambda: driver.process.poll() is not None, "the job to end", timeout_s=180)
    assert driver.process.returncode == 0 and "succeeded" in driver.text(), driver.text()[-5000:]
    run = storage / "submitted"
    assert summary(run)["global_step"] == 8
    assert sorted(checkpoint_folders(run).values())[-2:] == [4, 8], "the workers read the config file"


def test_a_node_that_does_not_see_the_runs_folder_is_named_before_training(tmp_path, cluster, monkeypatch, capsys):
    storage = tmp_path / "runs"
    storage.mkdir()
    cluster.add_node("unshared", hidden=storage)  # sees an empty tmpfs where the others see the folder
    try:
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        code = run_on_ray(None, ONE_EPOCH, RayRun(num_workers=(1, 1), name="r", storage_path=str(storage)))
    finally:
        cluster.lose_node("unshared")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, errors
    assert re.fullmatch(rf"error: node \S+ \(id [0-9a-f]{{8}}\) does not see {storage / 'r'} as the driver wrote it: "
                        r"the Ray run's folder .* must be one folder every node mounts at the same path .*",
                        errors[0]), errors
