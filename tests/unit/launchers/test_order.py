"""The dialects asked in order: the job each names, and what a child process inherits."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer import launchers
from trainer.launchers import LAUNCHERS, LaunchEnv, identity_from_env, launcher_of, without_launcher_variables
from trainer.launchers.plain import PlainEnvironment
from trainer.launchers.pytorchjob import PyTorchJob
from trainer.launchers.ray_train import RayTrain
from trainer.launchers.single import SingleProcess
from trainer.launchers.slurm import SlurmBatchScript, SlurmTasks
from trainer.launchers.slurm_torchrun import TorchrunUnderSlurm
from trainer.launchers.torchrun import Torchrun
from trainer.launchers.trainjob import TrainJob

TORCHRUN_NODE1_RANK3 = {
    "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "MASTER_ADDR": "node0", "MASTER_PORT": "41231",
    "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0",
}


def test_the_job_a_restart_belongs_to_is_named_by_what_each_launcher_keeps_across_restarts():
    pytorchjob = {"MASTER_ADDR": "mnist-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1",
                  "PET_NNODES": "2"}
    compose = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert identity_from_env(TORCHRUN_NODE1_RANK3, hostname="h").job == "torchrun-job"
    no_run_id = {**TORCHRUN_NODE1_RANK3, "TORCHELASTIC_RUN_ID": "none"}  # torchrun without --rdzv-id
    # Only an address names ranks started by hand: with the kernel boot id of rank 0's host (two stacks whose first
    # node is node0, on two hosts, are two jobs). torchrun's and a PyTorchJob's master may come back on another node.
    boot = "0f1e2d3c-aaaa-bbbb-cccc-000000000000"
    assert identity_from_env(no_run_id, boot_id=boot).job == "torchrun@node0:41231"
    assert identity_from_env(pytorchjob, hostname="mnist-worker-0", boot_id=boot).job == \
        "pytorchjob@mnist-master-0:23456"
    assert identity_from_env(compose, hostname="node1", boot_id=boot).job == "env@node0:29500/0f1e2d3c"
    assert identity_from_env(compose, hostname="node1", boot_id="").job == "env@node0:29500"  # not Linux
    assert identity_from_env({**compose, "DDP_JOB_ID": "nightly-7"}).job == "nightly-7"
    # Addresses every host has (loopback, and the unspecified 0.0.0.0 and ::) name no job: each process is its own.
    for everywhere in ("127.0.0.1", "localhost", "0.0.0.0", "::", "[::]", "::1", "127.1", "::ffff:127.0.0.1",
                       "localhost6"):
        identity = identity_from_env({**compose, "MASTER_ADDR": everywhere}, hostname="node1")
        assert identity.job.startswith("env-node1-") and not identity.job_named, everywhere
    # torchrun under Slurm: the Slurm job, and the torchrun app within it (unless its run id is the job's).
    assert identity_from_env({**TORCHRUN_NODE1_RANK3, "SLURM_JOB_ID": "812"}).job == "slurm-job-812-torchrun-job"
    assert identity_from_env({**TORCHRUN_NODE1_RANK3, "SLURM_JOB_ID": "812", "TORCHELASTIC_RUN_ID": "812"}
                             ).job == "slurm-job-812"
    # A single process has nothing a restart keeps: each run is its own job (its lease is released at exit).
    assert identity_from_env({}, hostname="laptop").job.startswith("process-laptop-")
    assert identity_from_env({**compose, "DDP_JOB_ID": "nightly-7"}, job_id="flagged").job == "flagged"  # the flag wins
    assert identity_from_env({**TORCHRUN_NODE1_RANK3, "SLURM_JOB_ID": "812", "SLURM_CLUSTER_NAME": "north",
                              "TORCHELASTIC_RUN_ID": "812"}).job == "slurm-job-north-812"


SLURM_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r"}


@pytest.mark.parametrize(("variables", "dialect"), [
    ({}, SingleProcess),
    ({**TORCHRUN, "DDP_RAY_RUN": "/runs/r"}, RayTrain),  # Ray's workers look like torchrun's, and come first
    ({**SLURM_STEP, **TORCHRUN, "DDP_RAY_RUN": "/runs/r"}, RayTrain),  # a Ray cluster on Slurm's nodes
    ({**SLURM_STEP, **TORCHRUN}, TorchrunUnderSlurm),  # one torchrun per node under srun: torchrun's places
    (TORCHRUN, Torchrun),
    ({"RANK": "0", "WORLD_SIZE": "2", "PET_NNODES": "2"}, PyTorchJob),
    # RANK and WORLD_SIZE exported inside srun: Slurm places the task (its LOCAL_RANK); with LOCAL_RANK, the user.
    ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}, SlurmTasks),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}, PlainEnvironment),
    (SLURM_STEP, SlurmTasks),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, SlurmBatchScript),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, SingleProcess),  # a one-task job's script
    ({"PET_NNODES": "2", "TORCHELASTIC_RUN_ID": "r"}, TrainJob),  # no RANK: not torchrun's worker
])
def test_the_first_dialect_in_the_order_that_detects_the_environment_reads_it(variables, dialect):
    assert type(launcher_of(LaunchEnv(variables, "h"))) is dialect


def test_every_dialect_module_is_in_the_order_and_has_its_own_test_module():
    """A new dialect is one module in trainer/launchers plus its test here (and its place in LAUNCHERS)."""
    package = Path(launchers.__file__).parent
    shared = {"__init__", "base", "identity", "hostlist"}
    modules = {path.stem for path in package.glob("*.py")} - shared
    ordered = {type(launcher).__module__.rsplit(".", 1)[1] for launcher in LAUNCHERS}
    assert modules == ordered, "a dialect module whose class is not in LAUNCHERS, or the reverse"
    for module in modules:
        assert (Path(__file__).parent / f"test_{module}.py").is_file(), f"no tests/unit/launchers/test_{module}.py"
    assert len({launcher.name for launcher in LAUNCHERS}) >= len(LAUNCHERS) - 1  # only torchrun's variant shares


def test_a_child_process_inherits_no_variable_any_dialect_reads():
    inherited = without_launcher_variables({**TORCHRUN, **SLURM_STEP, "PET_NNODES": "2", "NODE_RANK": "1",
                                            "MASTER_ADDR": "a", "DDP_JOB_ID": "j", "PATH": "/bin"})
    assert inherited == {"PATH": "/bin"}
