"""One torchrun per node under Slurm (``srun torchrun ...``, slurm/train.sbatch's LAUNCH=torchrun): torchrun's
variables say who the process is, Slurm's job id and step which job (a requeue keeps them), with torchrun's run
id where it is not the job id (two torchrun apps in one allocation)."""

from __future__ import annotations

from trainer.launchers.base import LaunchEnv
from trainer.launchers.slurm import slurm_job
from trainer.launchers.torchrun import Torchrun


class TorchrunUnderSlurm(Torchrun):
    def detect(self, env: LaunchEnv) -> bool:
        return super().detect(env) and env.has("SLURM_JOB_ID")

    def job(self, env: LaunchEnv, master_addr: str, master_port: int) -> tuple[str, bool]:
        return slurm_job(env, env.get("TORCHELASTIC_RUN_ID"))
