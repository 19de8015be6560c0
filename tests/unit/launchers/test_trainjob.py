"""Kubeflow Trainer v2: PET_* alone."""

from __future__ import annotations

import pytest

from trainer.errors import LaunchEnvError
from trainer.launchers import identity_from_env


def test_trainer_v2_pet_variables_alone_ask_for_torchrun():
    env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "t-node-0-0.t",
           "PET_MASTER_PORT": "29500"}
    with pytest.raises(LaunchEnvError, match="PET_.*torchrun"):
        identity_from_env(env)
