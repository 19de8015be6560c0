"""One torchrun per node under Slurm: torchrun's places, Slurm's job."""

from __future__ import annotations

from tests.unit.launchers.test_slurm import TASK_1
from trainer.launchers import identity_from_env


def test_torchrun_started_by_srun_is_the_torchrun_dialect():
    # srun --ntasks-per-node=1 torchrun ...: the workers see torchrun's variables and the step's.
    env = {**TASK_1, "SLURM_PROCID": "1", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29400",
           "TORCHELASTIC_RUN_ID": "7"}
    identity = identity_from_env(env)
    assert (identity.launcher, identity.rank, identity.node_rank) == ("torchrun", 3, 1)
    assert (identity.job, identity.job_named) == ("slurm-job-ci-1.0-torchrun-7", True)  # kept by a requeue
