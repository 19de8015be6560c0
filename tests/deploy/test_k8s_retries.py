"""Retries with an end: what each job does with each exit code, as docs/checkpoints.md's table says, and a
deadline on every job, set in one place per kind of job."""

from __future__ import annotations

import contextlib

import pytest

from tests.support.k8s_manifests import K8S_DIR, REPO_ROOT, SOURCES, of_kind, render
from tests.support.k8s_operator import CONTAINER, retries

RAYJOB_SOURCES = ("k8s/ray", "k8s/overlays/rayjob-streamed-data")
# Where each kind of job reads its deadline: the PyTorchJob's runPolicy, the TrainJob's and the RayJob's spec.
DEADLINE = {"PyTorchJob": ("spec", "runPolicy", "activeDeadlineSeconds"),
            "TrainJob": ("spec", "activeDeadlineSeconds"), "RayJob": ("spec", "activeDeadlineSeconds")}
# The one file per kind that sets it; k8s/pytorchjob.yaml is the base's copy for `kubectl apply -f k8s/`.
DEADLINE_FILES = {"k8s/base/pytorchjob.yaml", "k8s/pytorchjob.yaml", "k8s/trainer-v2/trainjob.yaml",
                  "k8s/ray/rayjob.yaml"}


COLUMNS = ("pytorchjob", "torchrun", "slurm", "ray")  # the table's columns after the code and its meaning


def exit_code_table() -> dict[int, dict[str, bool]]:
    """docs/checkpoints.md's "Exit codes" table: for each code, whether each launcher runs the job again."""
    section = REPO_ROOT.joinpath("docs/checkpoints.md").read_text().split("### Exit codes", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0].isdigit():
            assert len(cells) == 2 + len(COLUMNS), line
            said = [cell.split(maxsplit=1)[0].rstrip(":,") for cell in cells[2:]]
            assert set(said) <= {"yes", "no"}, line
            table[int(cells[0])] = {column: word == "yes" for column, word in zip(COLUMNS, said, strict=True)}
    return table


def column(name: str) -> dict[int, bool]:
    return {code: launchers[name] for code, launchers in exit_code_table().items()}


def test_the_table_names_every_code_the_trainer_exits_with_and_those_kubernetes_jobs_meet():
    from trainer import errors

    table = exit_code_table()
    exits = {value for name, value in vars(errors).items() if name.startswith("EXIT_")}
    assert exits | {137} == set(table), table


@pytest.mark.parametrize("source", SOURCES)
def test_each_replica_s_restart_policy_retries_what_the_table_says(source):
    for job in of_kind(render(source), "PyTorchJob"):
        for rtype, replica in job["spec"]["pytorchReplicaSpecs"].items():
            policy = replica["restartPolicy"]
            (container,) = [c for c in replica["template"]["spec"]["containers"] if c["name"] == CONTAINER]
            if policy == "ExitCode":
                assert {code: retries(policy, code) for code in exit_code_table()} == column("pytorchjob"), rtype
            else:
                # torchrun exits 1 whatever its workers did: every failure is retried, up to backoffLimit restarts
                # (container restarts in place, which the operator's backoff count sees).
                assert (container["command"], policy) == (["torchrun"], "OnFailure"), rtype
                assert {code: retries(policy, code) for code in exit_code_table()} == column("torchrun"), rtype
                assert job["spec"]["runPolicy"]["backoffLimit"] >= 1


def test_the_slurm_script_requeues_what_the_table_says(tmp_path):
    """The batch script's own end, run with an srun that exits with each code and an scontrol that records what it
    is asked: 200 is requeued (a bounded number of times); 143 comes from a requeue already under way (the USR1
    trap or scontrol requeue sent the SIGTERM), so the script's end does not requeue it again."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nexit "$FAKE_EXIT"\n')
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$FAKE_LOG"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)

    def requeued(code: int) -> bool:
        log = tmp_path / "scontrol.log"
        log.unlink(missing_ok=True)
        # SLURM_RESTART_COUNT counts time-limit requeues too: they do not use up the script's own budget.
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_EXIT": str(code), "FAKE_LOG": str(log),
               "SLURM_JOB_ID": "812", "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS": "2",
               "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_RESTART_COUNT": "7"}
        ended = subprocess.run(["bash", str(REPO_ROOT / "slurm/train.sbatch")], env=env, capture_output=True,
                               text=True, timeout=60)
        assert ended.returncode == code, ended.stdout + ended.stderr
        return log.exists() and log.read_text() == "requeue 812\n"

    expected = {code: retry for code, retry in column("slurm").items() if code != 143}
    assert {code: requeued(code) for code in expected} == expected
    # DDP_REQUEUES (3) in a row at most; any other end (here a preemption, checkpoint written) starts the count again.
    assert [requeued(200) for _ in range(4)] == [True, True, False, True]
    assert requeued(143) is False
    assert [requeued(200) for _ in range(4)] == [True, True, True, False]
    (tmp_path / ".ddp-requeues-812").write_text("")  # a count cut short: never taken for none
    assert requeued(200) is False


def test_ray_runs_the_worker_group_again_for_what_the_table_says(monkeypatch):
    """A worker whose trainer exits with a code other than 0 fails (Ray restarts the group, FailureConfig)."""
    from trainer.launchers.ray_train import RAY_RUN_VARIABLE
    from trainer.on_ray import worker

    monkeypatch.setenv(RAY_RUN_VARIABLE, "")  # the worker sets it: restored afterwards
    # Outside a Ray worker the drain watch's node id would start a local Ray (ray.get_runtime_context()), which
    # later tests would then find joined.
    monkeypatch.setattr(worker, "stop_when_this_node_drains", lambda requests: contextlib.nullcontext())

    def fails_for(code: int) -> bool:
        monkeypatch.setattr(worker, "run", lambda *args, **kwargs: code)
        try:
            worker.train_in_worker({"run": "/runs/r", "argv": [], "checkpoints": "/nonexistent", "task": None,
                                     "settings": {}})
        except RuntimeError:
            return True
        return False

    assert {code: fails_for(code) for code in exit_code_table()} == column("ray")


@pytest.mark.parametrize("source", (*SOURCES, *RAYJOB_SOURCES))
def test_every_job_has_a_deadline_that_ends_its_retries(source):
    jobs = [obj for obj in render(source) if obj["kind"] in DEADLINE]
    assert jobs, source
    for job in jobs:
        value = job
        for key in DEADLINE[job["kind"]]:
            value = value.get(key, {})
        assert isinstance(value, int) and 3600 <= value <= 7 * 86400, f"{job['kind']}: {value!r}"


def test_each_kind_of_job_sets_its_deadline_in_one_place():
    setting = {path.relative_to(K8S_DIR.parent).as_posix() for path in K8S_DIR.rglob("*.yaml")
               if not path.is_symlink() and "activeDeadlineSeconds:" in path.read_text()}
    assert setting == DEADLINE_FILES
