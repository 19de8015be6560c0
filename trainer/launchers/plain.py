"""Plain variables, set by hand or by a container platform: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, optionally ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``NODE_RANK``.

(Docker Compose here runs torchrun in each container, the torchrun dialect; containers that set these
variables themselves are this one.)

Inside an srun step, ``RANK`` and ``WORLD_SIZE`` exported without ``LOCAL_RANK`` (a common sbatch idiom) are
not this dialect: Slurm's own variables say more (each task's local rank, the step's nodes, the job that a
requeue keeps), and the Slurm dialect reads them, checking that the two agree.
With ``LOCAL_RANK`` too, the variables are this dialect's, and the job is still Slurm's."""

from __future__ import annotations

from trainer.launchers.base import LaunchEnv, Launcher, master_address, rank_and_world_size
from trainer.launchers.identity import DistIdentity
from trainer.launchers.slurm import in_srun_step, slurm_job


class PlainEnvironment(Launcher):
    name = "env"
    variables = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")

    def detect(self, env: LaunchEnv) -> bool:
        return env.launched() and (env.has("LOCAL_RANK") or not in_srun_step(env))

    def identity(self, env: LaunchEnv) -> DistIdentity:
        rank, world_size = rank_and_world_size(env)
        local_rank = env.number_or("LOCAL_RANK", 0, "set LOCAL_RANK to the process's index on its node")
        local_world_size = env.number_or("LOCAL_WORLD_SIZE", 1, "set LOCAL_WORLD_SIZE to processes per node",
                                         minimum=1)
        node_rank = env.number_or("NODE_RANK", rank // local_world_size, "set NODE_RANK to the node's index")
        num_nodes = max(1, world_size // local_world_size)
        return self.place(env, rank, local_rank, world_size, local_world_size, node_rank, num_nodes,
                          master_address(env, world_size))

    def job(self, env: LaunchEnv, master_addr: str, master_port: int) -> tuple[str, bool]:
        # In an srun step a requeue may start on another first node: the job and step, not the master's address,
        # are kept. (Processes the batch script starts itself are told apart by their address, as anywhere.)
        return slurm_job(env) if in_srun_step(env) else self.job_at_address(env, master_addr, master_port)
