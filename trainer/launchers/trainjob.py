"""Kubeflow Trainer v2 (TrainJob): it sets only ``PET_*``, torchrun's options, so its command must be torchrun
(then the torchrun dialect reads the variables torchrun sets). Started directly, the trainer refuses."""

from __future__ import annotations

from trainer.errors import LaunchEnvError
from trainer.launchers.base import TORCHRUN_HINT, LaunchEnv, Launcher
from trainer.launchers.identity import DistIdentity


class TrainJob(Launcher):
    name = "trainjob"
    prefixes = ("PET_",)

    def detect(self, env: LaunchEnv) -> bool:
        return not env.launched() and bool(env.prefixed("PET_"))

    def identity(self, env: LaunchEnv) -> DistIdentity:
        raise LaunchEnvError(f"{', '.join(env.prefixed('PET_'))} set but RANK and WORLD_SIZE are not: PET_* "
                             f"variables are torchrun's options (Kubeflow Trainer sets only these); {TORCHRUN_HINT}")
