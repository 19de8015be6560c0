"""Ray Train's workers, as ``ddp-train-ray`` (trainer.on_ray) starts them: Ray's TorchConfig sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in each
worker, and the worker function adds ``DDP_RAY_RUN``, the Ray run's folder (``RunConfig``'s storage path and name).

It comes before torchrun's dialect, which the same ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` would otherwise claim.
The job is the Ray run: every worker group Ray starts for it (after a failure, a resize, or the driver started
again with the same ``RunConfig``) is the same job, and another run (another name or storage path) is not.
"""

from __future__ import annotations

from trainer.launchers.base import LaunchEnv, Launcher, master_address, rank_and_world_size
from trainer.launchers.identity import DistIdentity

RAY_RUN_VARIABLE = "DDP_RAY_RUN"


class RayTrain(Launcher):
    name = "ray"
    variables = (RAY_RUN_VARIABLE, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                 "MASTER_ADDR", "MASTER_PORT")

    def detect(self, env: LaunchEnv) -> bool:
        return env.launched() and env.has(RAY_RUN_VARIABLE)

    def identity(self, env: LaunchEnv) -> DistIdentity:
        rank, world_size = rank_and_world_size(env)
        local_rank = env.number_or("LOCAL_RANK", 0, "set by Ray Train")
        local_world_size = env.number_or("LOCAL_WORLD_SIZE", 1, "set by Ray Train", minimum=1)
        node_rank = env.number_or("NODE_RANK", 0, "set by Ray Train")
        num_nodes = max(1, world_size // local_world_size)
        return self.place(env, rank, local_rank, world_size, local_world_size, node_rank, num_nodes,
                          master_address(env, world_size))

    def job(self, env: LaunchEnv, master_addr: str, master_port: int) -> tuple[str, bool]:
        # Each worker group of one run listens on another worker's address and a new port: the run is the job.
        return f"ray-run:{env.get(RAY_RUN_VARIABLE)}", True
