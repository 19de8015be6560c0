"""Kubeflow's PyTorchJob v1 with the trainer started directly in the pod."""

from __future__ import annotations

import pytest

from trainer.errors import LaunchEnvError
from trainer.launchers import identity_from_env


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
