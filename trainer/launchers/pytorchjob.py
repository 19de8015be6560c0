"""Kubeflow's PyTorchJob (training operator v1) with the trainer started directly in each pod.

``RANK`` is the *pod* index and ``WORLD_SIZE`` is replicas x nprocPerNode, so ``RANK`` is a process rank only
when each pod runs one process; ``PET_*`` variables are torchrun's own options, set for a torchrun command.
"""

from __future__ import annotations

from trainer.errors import LaunchEnvError
from trainer.launchers.base import TORCHRUN_HINT, LaunchEnv, Launcher, master_address, rank_and_world_size
from trainer.launchers.identity import DistIdentity


class PyTorchJob(Launcher):
    name = "pytorchjob"
    variables = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    prefixes = ("PET_",)

    def detect(self, env: LaunchEnv) -> bool:
        return env.launched() and bool(env.prefixed("PET_"))

    def identity(self, env: LaunchEnv) -> DistIdentity:
        rank, world_size = rank_and_world_size(env)
        _refuse_pod_index_as_process_rank(env, world_size)
        return self.place(env, rank, 0, world_size, 1, rank, world_size, master_address(env, world_size))


def _refuse_pod_index_as_process_rank(env: LaunchEnv, world_size: int) -> None:
    nproc, nnodes = env.get("PET_NPROC_PER_NODE"), env.get("PET_NNODES")
    if nproc and nproc != "auto":
        processes = env.number("PET_NPROC_PER_NODE", "set nprocPerNode to an integer")
        if processes > 1:
            raise LaunchEnvError(
                f"PET_NPROC_PER_NODE={processes}: each pod should run {processes} processes, but this process "
                f"was started directly, so RANK={env.get('RANK')} is the pod's index, not a process rank; "
                f"{TORCHRUN_HINT}, or set nprocPerNode: 1"
            )
    if nnodes and ":" not in nnodes:
        pods = env.number("PET_NNODES", "set by the training operator", minimum=1)
        if pods != world_size:
            raise LaunchEnvError(
                f"WORLD_SIZE={world_size} but PET_NNODES={pods}: each pod is meant to run "
                f"{world_size // max(pods, 1)} processes, so RANK is the pod's index, not a process rank; "
                f"{TORCHRUN_HINT}"
            )
