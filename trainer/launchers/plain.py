"""Plain variables, set by hand or by a container platform: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, optionally ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``NODE_RANK``.

(Docker Compose here runs torchrun in each container, the torchrun dialect; containers that set these
variables themselves are this one.)"""

from __future__ import annotations

from trainer.launchers.base import LaunchEnv, Launcher, master_address, rank_and_world_size
from trainer.launchers.identity import DistIdentity


class PlainEnvironment(Launcher):
    name = "env"
    variables = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")

    def detect(self, env: LaunchEnv) -> bool:
        return env.launched()

    def identity(self, env: LaunchEnv) -> DistIdentity:
        rank, world_size = rank_and_world_size(env)
        local_rank = env.number_or("LOCAL_RANK", 0, "set LOCAL_RANK to the process's index on its node")
        local_world_size = env.number_or("LOCAL_WORLD_SIZE", 1, "set LOCAL_WORLD_SIZE to processes per node",
                                         minimum=1)
        node_rank = env.number_or("NODE_RANK", rank // local_world_size, "set NODE_RANK to the node's index")
        num_nodes = max(1, world_size // local_world_size)
        return self.place(env, rank, local_rank, world_size, local_world_size, node_rank, num_nodes,
                          master_address(env, world_size))
