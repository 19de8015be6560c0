"""slurm/train.sbatch on a real Slurm cluster: Debian's Slurm with two emulated nodes on this machine.

`make slurm-up` (scripts/slurm-local.sh) starts the cluster (nodes n1 and n2, two CPUs each; n1 and n2 are
this machine, so both share its network and host name). Where no cluster answers these tests skip, except under CI=true.
Jobs run this checkout's trainer through PYTHON (the venv's interpreter), as a user's would run theirs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devtools.processes import REPO_ROOT
from tests.support.checkpoint_reading import assert_same_tensors, newest_checkpoint, summary
from tests.support.preconditions import unavailable
from trainer.launchers import without_launcher_variables

pytestmark = pytest.mark.slow

SBATCH = REPO_ROOT / "slurm" / "train.sbatch"
SUBSET = REPO_ROOT / "trainer" / "data" / "fashion_mnist_subset"
# 2 epochs of 100 steps on 4 ranks, a checkpoint every 10 steps: about 5 s of training, long enough to be
# requeued twice in the middle.
LONG = ["--dataset", "fashion-mnist", "--data-dir", str(SUBSET), "--epochs", "2", "--max-train-samples", "3200",
        "--max-test-samples", "500", "--batch-size", "8", "--checkpoint-every", "10", "--progress", "off"]
SHORT = ["--dataset", "synthetic", "--epochs", "1", "--max-train-samples", "256", "--max-test-samples", "64",
         "--batch-size", "16", "--progress", "off"]
JOB_TIMEOUT_S = 240
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING"}


def slurm(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.fixture(scope="module")
def cluster() -> None:
    if shutil.which("sbatch") is None:
        unavailable("Slurm is not installed (make slurm-up, as root, installs it and starts a local cluster)")
    idle = slurm("sinfo", "-h", "-t", "idle", "-o", "%D")
    if idle.returncode != 0 or sum(int(n) for n in idle.stdout.split()) < 2:
        unavailable(f"no Slurm cluster with two idle nodes answers ({idle.stderr.strip() or idle.stdout.strip()}); "
                    "make slurm-up starts one")


@dataclass
class Job:
    id: str
    output: Path

    def log(self) -> str:
        return self.output.read_text() if self.output.exists() else ""

    def state(self) -> dict[str, str]:
        shown = slurm("scontrol", "show", "job", "--oneliner", self.id)
        assert shown.returncode == 0, shown.stderr
        return dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)

    def wait_for(self, pattern: str, count: int = 1, timeout_s: float = JOB_TIMEOUT_S) -> float:
        """Until the log holds `count` lines matching; returns when (time.monotonic())."""
        deadline = time.monotonic() + timeout_s
        while len(re.findall(pattern, self.log(), re.M)) < count:
            assert time.monotonic() < deadline, f"no {count} x {pattern!r} in job {self.id} within {timeout_s} s:\n" \
                                                f"{self.log()[-5000:]}"
            time.sleep(0.1)
        return time.monotonic()

    def finish(self, timeout_s: float = JOB_TIMEOUT_S) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while (state := self.state())["JobState"] in ACTIVE:
            if time.monotonic() > deadline:
                slurm("scancel", self.id)
                raise AssertionError(f"job {self.id} still {state['JobState']} after {timeout_s} s: a hang\n"
                                     f"{self.log()[-5000:]}")
            time.sleep(0.2)
        return state


def sbatch(workdir: Path, log_name: str, flags: tuple[str, ...], options: tuple[str, ...] = (),
           script: Path = SBATCH, settings: dict[str, str] | None = None) -> Job:
    """Submit ``script`` with trainer flags from ``workdir``, as a user does; the job's log is workdir/log_name."""
    env = {**without_launcher_variables(os.environ), "PYTHON": sys.executable, **(settings or {})}
    output = workdir / log_name
    submitted = subprocess.run(["sbatch", "--parsable", f"--output={output}", *options, str(script), *flags],
                               capture_output=True, text=True, env=env, cwd=workdir, timeout=30, check=False)
    assert submitted.returncode == 0, submitted.stderr
    return Job(submitted.stdout.strip().split(";")[0], output)


@pytest.fixture
def submit(cluster: None, tmp_path: Path) -> Iterator[Any]:
    """sbatch slurm/train.sbatch with trainer flags, as a user submits it; cancels what is left at the end."""
    jobs: list[Job] = []

    def submit_job(*flags: str, options: tuple[str, ...] = (), script: Path = SBATCH, **settings: str) -> Job:
        jobs.append(sbatch(tmp_path, f"job-{len(jobs)}.out", flags, options, script, settings))
        return jobs[-1]

    yield submit_job
    for job in jobs:
        slurm("scancel", job.id)


def final_model(output_dir: Path) -> dict[str, Any]:
    name, manifest, state = newest_checkpoint(output_dir / "checkpoints")
    return {"name": name, "step": manifest["step"], "model": state["model"], "optimizer": state["optimizer"]}


@pytest.fixture(scope="module")
def uninterrupted(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference: the long run, 2 nodes x 2 tasks, never interrupted."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    job = sbatch(workdir, "job.out", (*LONG, "--output-dir", str(workdir / "run")))
    state = job.finish()
    return {"job": job, "state": state, "summary": summary(workdir / "run"), **final_model(workdir / "run")}


def test_a_two_node_job_of_two_tasks_each_trains_to_the_end_with_every_rank(uninterrupted):
    state, final, log = uninterrupted["state"], uninterrupted["summary"], uninterrupted["job"].log()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), log[-5000:]
    ranks = sorted(final["ranks"], key=lambda rank: rank["rank"])
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0, 0), (1, 0, 1), (2, 1, 0),
                                                                             (3, 1, 1)]
    assert {(r["launcher"], r["world_size"], r["num_nodes"], r["local_world_size"]) for r in ranks} == {
        ("slurm", 4, 2, 2)}
    job_id = int(uninterrupted["job"].id)
    assert {(r["master_addr"], r["master_port"]) for r in ranks} == {("n1", 20000 + job_id % 10000)}, \
        "the master: the first node of the node list, the port from the job id"
    assert final["epochs_completed"] == 2 and final["global_step"] == 200 and final["test_samples"] == 500
    assert f"final test accuracy {final['test_accuracy']:.4f}" in log
    assert "train.sbatch: srun exited with 0" in log


def test_a_job_requeued_at_its_time_limit_and_by_scontrol_resumes_to_the_uninterrupted_model(uninterrupted,
                                                                                                 submit, tmp_path):
    job = submit(*LONG, "--output-dir", str(tmp_path / "run"))
    job.wait_for(r"checkpoint \S+ written")
    # What Slurm does at --signal=B:USR1@120 before the time limit: USR1 to the batch script only.
    signalled = slurm("scancel", "--batch", "--signal=USR1", job.id)
    assert signalled.returncode == 0, signalled.stderr
    job.wait_for(r"^train\.sbatch: job \d+, run 2,")
    job.wait_for(r"resumed from \S+/step-\d+", count=4)  # every rank of run 2
    checkpoints_so_far = len(re.findall(r"checkpoint \S+ written", job.log()))
    job.wait_for(r"checkpoint \S+ written", count=checkpoints_so_far + 1)
    requeued_at = time.monotonic()
    requeued = slurm("scontrol", "requeue", job.id)
    assert requeued.returncode == 0, requeued.stderr
    resumed_at = job.wait_for(r"resumed from \S+/step-\d+", count=8)
    state = job.finish()
    log = job.log()
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "2"), log[-5000:]
    assert "train.sbatch: time limit near: requeueing job" in log
    # Each interruption: every rank stopped on SIGTERM, the checkpoint was written, every rank exited 143.
    # A rank may learn of the stop from the others before its own SIGTERM arrives: it stops at the same step.
    assert len(re.findall(r"(received SIGTERM|another rank received a stop signal): stopping at step \d+ to write a "
                          r"checkpoint", log)) == 8
    assert len(re.findall(r"preempted at step \d+; checkpoint written; exiting with 143", log)) == 8
    stops = [int(step) for step in re.findall(r"\[rank 0\] preempted at step (\d+)", log)]
    resumes = [int(step) for step in re.findall(r"\[rank 0/4\] INFO resumed from \S+: epoch \d+, step (\d+)", log)]
    assert resumes == stops and len(stops) == 2 and 0 < stops[0] < stops[1] < 200, (stops, resumes)
    final = summary(tmp_path / "run")
    assert {rank["restart_count"] for rank in final["ranks"]} == {2}, "SLURM_RESTART_COUNT reached the trainer"
    assert final["global_step"] == uninterrupted["summary"]["global_step"]
    assert final["test_accuracy"] == uninterrupted["summary"]["test_accuracy"]
    model = final_model(tmp_path / "run")
    assert model["step"] == uninterrupted["step"]
    assert_same_tensors(model["model"], uninterrupted["model"])
    assert_same_tensors(model["optimizer"], uninterrupted["optimizer"])
    print(f"scontrol requeue to every rank resumed: {resumed_at - requeued_at:.1f} s")


def test_one_torchrun_per_node_under_srun_trains(submit, tmp_path):
    # One node: two torchrun agents on one machine would both take the rendezvous endpoint for their own.
    job = submit(*SHORT, "--output-dir", str(tmp_path / "run"), options=("--nodes=1",), LAUNCH="torchrun")
    state = job.finish()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), job.log()[-5000:]
    final = summary(tmp_path / "run")
    assert final["world_size"] == 2 and {rank["launcher"] for rank in final["ranks"]} == {"torchrun"}
    assert "launch torchrun" in job.log()


def test_a_job_that_cannot_reach_its_master_fails_with_the_trainers_message_not_a_hang(submit, tmp_path):
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): nothing answers there, as with a master address on the wrong network.
    job = submit(*SHORT, "--output-dir", str(tmp_path / "run"), "--rendezvous-timeout-s", "5",
                 MASTER_ADDR="192.0.2.1")
    state = job.finish(timeout_s=120)
    log = job.log()
    assert state["JobState"] == "FAILED" and state["ExitCode"] != "0:0", log[-5000:]
    assert re.search(r"\[rank [123]\] error: master 192\.0\.2\.1:\d+ not reachable after 5s and \d+ attempts; "
                     r"last: .*Check MASTER_ADDR/MASTER_PORT", log), log[-5000:]
    assert "Traceback" not in log


def test_the_trainer_in_the_batch_script_itself_and_a_wrong_launch_mode_are_refused_in_one_line(submit, tmp_path):
    script = tmp_path / "no-srun.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=2\n"
                      f"exec {sys.executable} -m trainer --dataset synthetic --output-dir {tmp_path / 'run'}\n")
    without_srun = submit(script=script)
    wrong_mode = submit(*SHORT, LAUNCH="mpi")
    for job, message in [
        (without_srun, "[rank 0] error: SLURM_NTASKS=4 but this process runs in the batch script itself, not in "
                       "an srun step, so it would train alone as rank 0 of 4 and wait for the rest; start one task "
                       "per rank with srun (srun python -m trainer ...), or one torchrun per node (see "
                       "slurm/train.sbatch)"),
        (wrong_mode, "train.sbatch: error: LAUNCH=mpi: use tasks (one srun task per rank) or torchrun (one torchrun "
                     "per node)"),
    ]:
        state = job.finish(timeout_s=120)
        assert (state["JobState"], state["ExitCode"]) == ("FAILED", "2:0"), job.log()
        assert message in job.log().splitlines(), job.log()
