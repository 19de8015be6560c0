"""Every launcher's environment becomes the same DistIdentity; every inconsistency is one clear error."""

from __future__ import annotations

import os

import pytest

from trainer.env import identity_from_env
from trainer.errors import LaunchEnvError

TORCHRUN_NODE1_RANK3 = {
    "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "MASTER_ADDR": "node0", "MASTER_PORT": "41231",
    "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0",
}


def test_no_launcher_means_a_single_process():
    identity = identity_from_env({}, hostname="laptop")
    assert (identity.rank, identity.world_size, identity.local_rank, identity.num_nodes) == (0, 1, 0, 1)
    assert identity.launcher == "single-process" and identity.is_main and not identity.distributed


def test_torchrun_variables_give_process_node_and_local_ranks():
    identity = identity_from_env(TORCHRUN_NODE1_RANK3, hostname="h")
    assert identity.rank == 3 and identity.local_rank == 1 and identity.world_size == 4
    assert identity.local_world_size == 2 and identity.node_rank == 1 and identity.num_nodes == 2
    assert (identity.master_addr, identity.master_port) == ("node0", 41231)
    assert identity.launcher == "torchrun" and not identity.is_main and not identity.is_local_main


def test_pytorchjob_one_process_per_pod_uses_the_pod_index_as_rank():
    env = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2",
           "PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "job-master-0",
           "PET_MASTER_PORT": "23456", "PYTHONUNBUFFERED": "1"}
    identity = identity_from_env(env, hostname="job-worker-1")
    assert (identity.rank, identity.world_size, identity.node_rank, identity.num_nodes) == (2, 3, 2, 3)
    assert identity.launcher == "pytorchjob"


def test_pytorchjob_with_several_processes_per_pod_refuses_to_start_directly():
    env = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "4", "RANK": "1",
           "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1"}
    with pytest.raises(LaunchEnvError, match="PET_NPROC_PER_NODE=2.*pod's index.*torchrun"):
        identity_from_env(env)


def test_pytorchjob_world_size_larger_than_pods_refuses_even_with_auto_nproc():
    env = {"MASTER_ADDR": "m", "MASTER_PORT": "1", "WORLD_SIZE": "8", "RANK": "1", "PET_NNODES": "2",
           "PET_NPROC_PER_NODE": "auto"}
    with pytest.raises(LaunchEnvError, match="WORLD_SIZE=8 but PET_NNODES=2"):
        identity_from_env(env)


def test_trainer_v2_pet_variables_alone_ask_for_torchrun():
    env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "t-node-0-0.t",
           "PET_MASTER_PORT": "29500"}
    with pytest.raises(LaunchEnvError, match="PET_.*torchrun"):
        identity_from_env(env)


def test_plain_compose_style_environment():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    identity = identity_from_env(env, hostname="node1")
    assert (identity.rank, identity.local_rank, identity.node_rank, identity.num_nodes) == (1, 0, 1, 2)
    assert identity.launcher == "env"


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK='x' is not an integer"),
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK is set but WORLD_SIZE is not"),
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "99999"}, "MASTER_PORT=99999"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"RANK": "1", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "a",
      "MASTER_PORT": "1"}, "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
])
def test_inconsistent_environment_names_the_variable(env, message):
    with pytest.raises(LaunchEnvError, match=message):
        identity_from_env(env)


def test_the_job_a_restart_belongs_to_is_named_by_what_each_launcher_keeps_across_restarts():
    pytorchjob = {"MASTER_ADDR": "mnist-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1",
                  "PET_NNODES": "2"}
    compose = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert identity_from_env(TORCHRUN_NODE1_RANK3, hostname="h").job == "torchrun-job"
    no_run_id = {**TORCHRUN_NODE1_RANK3, "TORCHELASTIC_RUN_ID": "none"}  # torchrun without --rdzv-id
    assert identity_from_env(no_run_id).job == "torchrun@node0:41231"
    assert identity_from_env(pytorchjob, hostname="mnist-worker-0").job == "pytorchjob@mnist-master-0:23456"
    assert identity_from_env(compose, hostname="node1").job == "env@node0:29500"
    assert identity_from_env({**compose, "DDP_JOB_ID": "nightly-7"}).job == "nightly-7"
    assert identity_from_env({**TORCHRUN_NODE1_RANK3, "SLURM_JOB_ID": "812"}).job == "slurm-job-812"
    # A single process has nothing a restart keeps: each run is its own job (its lease is released at exit).
    assert identity_from_env({}, hostname="laptop").job.startswith("process-laptop-")
    assert identity_from_env({**compose, "DDP_JOB_ID": "nightly-7"}, job_id="flagged").job == "flagged"  # the flag wins
    assert identity_from_env({**TORCHRUN_NODE1_RANK3, "SLURM_JOB_ID": "812", "SLURM_CLUSTER_NAME": "north"}
                             ).job == "slurm-job-north-812"


def test_a_loopback_rendezvous_names_no_job_so_two_machines_jobs_are_never_taken_for_each_other():
    """torchrun without --standalone or --rdzv-id (static rendezvous, 127.0.0.1:29500) is the same on every host."""
    static = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}
    first, second = identity_from_env(static, hostname="host-a"), identity_from_env(static, hostname="host-b")
    assert first.job != second.job and not first.job_named and not second.job_named
    assert first.job == f"torchrun-agent-host-a-{os.getppid()}"  # the agent: kept across torchrun's restarts
    assert first.job == identity_from_env(static, hostname="host-a").job
    by_hand = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
    assert identity_from_env(by_hand, hostname="host-a").job == f"env-host-a-{os.getpid()}"
    for loopback in ("127.0.0.2", "::1", "[::1]"):
        assert not identity_from_env({**static, "MASTER_ADDR": loopback}).job_named
    named = identity_from_env(static, hostname="host-a", job_id="nightly")
    assert (named.job, named.job_named) == ("nightly", True)
    assert identity_from_env({**static, "MASTER_ADDR": "10.0.0.5"}).job_named  # other hosts reach it: a name
