"""One torchrun per node under Slurm (``srun torchrun ...``, slurm/train.sbatch's LAUNCH=torchrun): torchrun's
variables say who the process is, Slurm's job id which job (a requeue keeps it, torchrun's run id may not)."""

from __future__ import annotations

from trainer.launchers.base import LaunchEnv
from trainer.launchers.slurm import slurm_job
from trainer.launchers.torchrun import Torchrun


class TorchrunUnderSlurm(Torchrun):
    def detect(self, env: LaunchEnv) -> bool:
        return super().detect(env) and env.has("SLURM_JOB_ID")

    def job(self, env: LaunchEnv, master_addr: str, master_port: int) -> tuple[str, bool]:
        return slurm_job(env)
