"""torchrun, and what starts it (TorchX's ``dist.ddp``, Compose's containers, a TrainJob, a PyTorchJob with
torchrun as its command): ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``GROUP_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_*``."""

from __future__ import annotations

import os

from trainer.launchers.base import LaunchEnv, Launcher, is_loopback, master_address, rank_and_world_size
from trainer.launchers.identity import DistIdentity

# What every agent of an elastic job (--nnodes=MIN:MAX) needs in its environment. torch 2.14's agents share one
# TCPStore across rendezvous rounds by default, and then a node that joins a running job never completes the
# round: the agent that was rank 0 keeps its first round's MASTER_ADDR/MASTER_PORT and does not write them for
# the new round, while the newcomer waits for exactly those keys (dynamic_rendezvous.next_rendezvous), and every
# agent ends with DistStoreError after the join timeout. A store per round avoids it. The launch files set it
# (compose.yaml, k8s/overlays/elastic, the TorchX component); docs/elastic.md has the reproduction.
ELASTIC_AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class Torchrun(Launcher):
    name = "torchrun"
    variables = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")

    def detect(self, env: LaunchEnv) -> bool:
        return env.launched() and (env.has("TORCHELASTIC_RUN_ID") or env.has("LOCAL_RANK", "LOCAL_WORLD_SIZE"))

    def identity(self, env: LaunchEnv) -> DistIdentity:
        rank, world_size = rank_and_world_size(env)
        local_rank = env.number("LOCAL_RANK", "LOCAL_RANK comes from torchrun; do not set it by hand")
        local_world_size = env.number_or("LOCAL_WORLD_SIZE", 1, "set by torchrun", minimum=1)
        node_rank = env.number_or("GROUP_RANK", 0, "set by torchrun")
        num_nodes = env.number_or("GROUP_WORLD_SIZE", max(1, world_size // local_world_size), "set by torchrun",
                                  minimum=1)
        restart_count = env.number_or("TORCHELASTIC_RESTART_COUNT", 0, "set by torchrun")
        max_restarts = env.number_or("TORCHELASTIC_MAX_RESTARTS", 0, "set by torchrun")
        return self.place(env, rank, local_rank, world_size, local_world_size, node_rank, num_nodes,
                          master_address(env, world_size), restart_count=restart_count,
                          agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                          restarts_left=max(0, max_restarts - restart_count) if max_restarts > 0 else None)

    def job(self, env: LaunchEnv, master_addr: str, master_port: int) -> tuple[str, bool]:
        run_id = env.get("TORCHELASTIC_RUN_ID")
        if run_id not in ("", "none"):
            # --rdzv-id names the job (--standalone makes a random one per torchrun): kept across restarts, also
            # when a new rendezvous round moves the agent's store (MASTER_ADDR:MASTER_PORT) to another node.
            return f"torchrun-{run_id}", True
        if not is_loopback(master_addr):
            # Without the host's boot id (Launcher.job_at_address): a PyTorchJob's master pod that torchrun runs in
            # may come back on another node, and a lease kept for its next attempt must still be this job's.
            return f"torchrun@{master_addr}:{master_port}", True
        # A static rendezvous on a loopback address: its workers are the agent's children, and a restart keeps
        # the agent, so the attempt is the agent's (unnamed: another host's agent may have the same address).
        return f"torchrun-agent-{env.hostname}-{os.getppid()}", False
