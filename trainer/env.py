"""Who this process is: every launcher's environment normalised into one typed value.

This is the only module that reads launcher variables. Dialects:

* torchrun / TorchX (``dist.ddp`` runs torchrun): ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
* Kubeflow PyTorchJob v1, trainer started directly in the pod: ``RANK`` is the *pod* index
  and ``WORLD_SIZE`` is replicas x nprocPerNode, so ``RANK`` is a process rank only when each
  pod runs one process. ``PET_*`` variables are torchrun's own options.
* Kubeflow Trainer v2 (TrainJob): only ``PET_*``; the command must be ``torchrun``.
* Slurm, one task per rank (``srun python -m trainer``): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
  ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``, ``SLURMD_NODENAME``, ``SLURM_STEP_NODELIST`` (the
  master is its first host), ``SLURM_JOB_ID`` (the port: 20000 + id mod 10000, unless ``MASTER_PORT`` or
  ``--master-port`` names one), ``SLURM_RESTART_COUNT``. Only inside an ``srun`` step (``SLURM_STEP_ID``):
  the batch script itself also sees ``SLURM_PROCID=0`` and the job's task count. One ``torchrun`` per
  node under ``srun`` is the torchrun dialect: its variables win over Slurm's.
* Plain (Docker Compose, hand-written): ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
* Nothing set: one process.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from trainer.errors import LaunchEnvError
from trainer.hostlist import expand_counts, expand_hostlist

__all__ = ["LAUNCHER_PREFIXES", "LAUNCHER_VARIABLES", "DistIdentity", "identity_from_env", "without_launcher_variables"]

TORCHRUN_HINT = "start the trainer through torchrun (torchrun --nnodes ... --nproc-per-node ... trainer/main.py)"
SRUN_HINT = ("start one task per rank with srun (srun python -m trainer ...), or one torchrun per node "
             "(see slurm/train.sbatch)")
# Slurm job ids map to ports 20000-29999: below Linux's ephemeral range (32768-), so no outgoing
# connection holds one, and two jobs sharing a node collide only when their ids are 10000 apart.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000
# Every variable this module reads, and the prefixes of families of them: a process started from a
# launched one (a test, a benchmark, a nested launcher) must not inherit its parent's place in a group.
LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE", "DDP_JOB_ID",
)
LAUNCHER_PREFIXES = ("PET_", "SLURM_", "SLURMD_")


def without_launcher_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """environ less every launcher variable: what a process that starts a new group should pass on."""
    return {name: value for name, value in environ.items()
            if name not in LAUNCHER_VARIABLES and not name.startswith(LAUNCHER_PREFIXES)}


@dataclass(frozen=True)
class DistIdentity:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    launcher: str
    hostname: str
    restart_count: int = 0  # which attempt this is: torchrun's TORCHELASTIC_RESTART_COUNT, SLURM_RESTART_COUNT
    agent_store: bool = False  # torchrun's agent already serves the store at MASTER_ADDR:MASTER_PORT
    # What a restart of this job has in common with this attempt, and a concurrent other job cannot have
    # (see job_name): the checkpoint folder's lease lets "the same job" in at once.
    job: str = ""
    # False where no launcher names the job (a lone process, ranks started by hand on one host, torchrun's
    # static rendezvous on a loopback address): ``job`` is then this attempt's alone, and --job-id names it.
    job_named: bool = True

    @property
    def is_main(self) -> bool:
        """The one process that writes checkpoints, metrics and the progress bar."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """The one process per node that downloads or fetches data."""
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size}, "
            f"node {self.node_rank}/{self.num_nodes}) on {self.hostname} via {self.launcher}, "
            f"master {self.master_addr}:{self.master_port}"
        )

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _int(env: Mapping[str, str], name: str, fix: str, minimum: int = 0) -> int:
    raw = env[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise LaunchEnvError(f"{name}={raw!r} is not an integer; {fix}") from None
    if value < minimum:
        raise LaunchEnvError(f"{name}={value} must be >= {minimum}; {fix}")
    return value


def _master(env: Mapping[str, str], world_size: int, fix: str) -> tuple[str, int]:
    if world_size == 1 and "MASTER_ADDR" not in env:
        return "127.0.0.1", 0
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name, "").strip():
            raise LaunchEnvError(f"WORLD_SIZE={world_size} but {name} is not set; {fix}")
    port = _int(env, "MASTER_PORT", "set MASTER_PORT to the master's TCP port (1-65535)", minimum=1)
    if port > 65535:
        raise LaunchEnvError(f"MASTER_PORT={port} is not a TCP port; set it to a value in 1-65535")
    return env["MASTER_ADDR"].strip(), port


def identity_from_env(env: Mapping[str, str], hostname: str | None = None, master_port: int = 0,
                      job_id: str = "") -> DistIdentity:
    """Read the launcher's variables into a DistIdentity; one clear error for each inconsistency.

    ``master_port``: the port to use where the launcher names none (Slurm; --master-port), 0 to derive it.
    ``job_id``: --job-id, the job's name for the checkpoint folder's lease (see job_name)."""
    host = hostname or socket.gethostname()
    has = {name for name, value in env.items() if value.strip()}
    pet = sorted(name for name in has if name.startswith("PET_"))
    under_torchrun = "TORCHELASTIC_RUN_ID" in has or {"LOCAL_RANK", "LOCAL_WORLD_SIZE"} <= has

    if not has & {"RANK", "WORLD_SIZE", "LOCAL_RANK"}:
        if "SLURM_STEP_ID" in has and "SLURM_PROCID" in has:
            return _slurm_identity(env, has, host, master_port, job_id)
        if "SLURM_JOB_ID" in has and "SLURM_NTASKS" in has:
            tasks = _int(env, "SLURM_NTASKS", "set by Slurm", minimum=1)
            if tasks > 1:
                raise LaunchEnvError(
                    f"SLURM_NTASKS={tasks} but this process runs in the batch script itself, not in an srun "
                    f"step, so it would train alone as rank 0 of {tasks} and wait for the rest; {SRUN_HINT}"
                )
        if pet:
            raise LaunchEnvError(
                f"{', '.join(pet)} set but RANK and WORLD_SIZE are not: PET_* variables are torchrun's "
                f"options (Kubeflow Trainer sets only these); {TORCHRUN_HINT}"
            )
        job, named = job_name(env, "single-process", host, "", 0, job_id)
        return DistIdentity(0, 0, 1, 1, 0, 1, "127.0.0.1", 0, "single-process", host, job=job, job_named=named)

    if "WORLD_SIZE" not in has:
        present = "LOCAL_RANK" if "LOCAL_RANK" in has else "RANK"
        raise LaunchEnvError(
            f"{present} is set but WORLD_SIZE is not; set WORLD_SIZE to the total number of processes, "
            f"or {TORCHRUN_HINT}"
        )
    world_size = _int(env, "WORLD_SIZE", "set WORLD_SIZE to the total number of processes", minimum=1)
    if "RANK" not in has:
        raise LaunchEnvError(f"WORLD_SIZE={world_size} is set but RANK is not; set RANK (0..{world_size - 1})")
    rank = _int(env, "RANK", f"set RANK to this process's rank in 0..{world_size - 1}")
    if rank >= world_size:
        raise LaunchEnvError(
            f"RANK={rank} is not below WORLD_SIZE={world_size}; ranks run from 0 to {world_size - 1}"
        )

    if under_torchrun:
        launcher = "torchrun"
        local_rank = _int(env, "LOCAL_RANK", "LOCAL_RANK comes from torchrun; do not set it by hand")
        local_world_size = _int(env, "LOCAL_WORLD_SIZE", "set by torchrun", minimum=1) \
            if "LOCAL_WORLD_SIZE" in has else 1
        node_rank = _int(env, "GROUP_RANK", "set by torchrun") if "GROUP_RANK" in has else 0
        num_nodes = _int(env, "GROUP_WORLD_SIZE", "set by torchrun", minimum=1) \
            if "GROUP_WORLD_SIZE" in has else max(1, world_size // local_world_size)
    elif pet:
        launcher = "pytorchjob"
        _refuse_node_rank_as_process_rank(env, world_size)
        local_rank, local_world_size, node_rank, num_nodes = 0, 1, rank, world_size
    else:
        launcher = "env"
        local_rank = _int(env, "LOCAL_RANK", "set LOCAL_RANK to the process's index on its node") \
            if "LOCAL_RANK" in has else 0
        local_world_size = _int(env, "LOCAL_WORLD_SIZE", "set LOCAL_WORLD_SIZE to processes per node",
                                minimum=1) if "LOCAL_WORLD_SIZE" in has else 1
        node_rank = _int(env, "NODE_RANK", "set NODE_RANK to the node's index") \
            if "NODE_RANK" in has else rank // local_world_size
        num_nodes = max(1, world_size // local_world_size)

    if local_rank >= local_world_size:
        raise LaunchEnvError(
            f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}; "
            f"local ranks run from 0 to {local_world_size - 1}"
        )
    if local_world_size > world_size:
        raise LaunchEnvError(f"LOCAL_WORLD_SIZE={local_world_size} exceeds WORLD_SIZE={world_size}")
    master_addr, master_port = _master(env, world_size, "set MASTER_ADDR and MASTER_PORT to rank 0's host and port")
    restart_count = _int(env, "TORCHELASTIC_RESTART_COUNT", "set by torchrun") \
        if "TORCHELASTIC_RESTART_COUNT" in has else 0
    job, named = job_name(env, launcher, host, master_addr, master_port, job_id)
    return DistIdentity(rank, local_rank, world_size, local_world_size, node_rank, num_nodes,
                        master_addr, master_port, launcher, host, restart_count,
                        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True", job=job, job_named=named)


def job_name(env: Mapping[str, str], launcher: str, host: str, master_addr: str, master_port: int,
             job_id: str = "") -> tuple[str, bool]:
    """Who "the same job" is across restarts, for the checkpoint folder's lease: (name, whether a launcher or
    the user named it). It must be the same for every attempt of one job and differ between any two jobs that
    may share a checkpoint folder (two machines, one NFS folder or bucket).

    ``--job-id`` (``job_id``) or ``DDP_JOB_ID`` names it where set. Slurm: the job id (and the cluster's
    name), kept by a requeue. torchrun: its run id (``--rdzv-id``; ``--standalone`` draws one per torchrun).
    Otherwise a rendezvous address that other hosts reach (a PyTorchJob's ``<name>-master-0``, a TrainJob's
    first node, Compose's ``node0``): two jobs cannot listen on one at once. A loopback address
    (``127.0.0.1:29500``, torchrun's static default) is the same on every host, so it names nothing: under
    torchrun the attempt is its agent's (host and pid, kept across the agent's restarts), otherwise the
    process's own, and either is unnamed. A single process is its own job.
    """
    named = (job_id or env.get("DDP_JOB_ID", "")).strip()
    if named:
        return named, True
    if launcher in ("slurm", "torchrun") and env.get("SLURM_JOB_ID", "").strip():  # torchrun per node under sbatch
        cluster = env.get("SLURM_CLUSTER_NAME", "").strip()
        return f"slurm-job-{cluster + '-' if cluster else ''}{env['SLURM_JOB_ID'].strip()}", True
    if launcher == "single-process":
        return f"process-{host}-{os.getpid()}", False
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if launcher == "torchrun" and run_id not in ("", "none"):
        # --rdzv-id names the job (--standalone makes a random one per torchrun): kept across restarts, also
        # when a new rendezvous round moves the agent's store (MASTER_ADDR:MASTER_PORT) to another node.
        return f"torchrun-{run_id}", True
    if not is_loopback(master_addr):
        return f"{launcher}@{master_addr}:{master_port}", True
    if launcher == "torchrun":  # its workers are the agent's children, and a restart keeps the agent
        return f"torchrun-agent-{host}-{os.getppid()}", False
    return f"{launcher}-{host}-{os.getpid()}", False


def is_loopback(address: str) -> bool:
    """An address every host has for itself: it cannot tell one host's job from another's."""
    if address.strip().lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(address.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def _refuse_node_rank_as_process_rank(env: Mapping[str, str], world_size: int) -> None:
    """PyTorchJob v1 sets RANK to the pod index; that is a process rank only with one process per pod."""
    nproc_raw = env.get("PET_NPROC_PER_NODE", "").strip()
    nnodes_raw = env.get("PET_NNODES", "").strip()
    if nproc_raw and nproc_raw != "auto":
        nproc = _int(env, "PET_NPROC_PER_NODE", "set nprocPerNode to an integer")
        if nproc > 1:
            raise LaunchEnvError(
                f"PET_NPROC_PER_NODE={nproc}: each pod should run {nproc} processes, but this process "
                f"was started directly, so RANK={env['RANK']} is the pod's index, not a process rank; "
                f"{TORCHRUN_HINT}, or set nprocPerNode: 1"
            )
    if nnodes_raw and ":" not in nnodes_raw:
        nnodes = _int(env, "PET_NNODES", "set by the training operator", minimum=1)
        if nnodes != world_size:
            raise LaunchEnvError(
                f"WORLD_SIZE={world_size} but PET_NNODES={nnodes}: each pod is meant to run "
                f"{world_size // max(nnodes, 1)} processes, so RANK is the pod's index, not a process rank; "
                f"{TORCHRUN_HINT}"
            )


def _slurm_identity(env: Mapping[str, str], has: set[str], host: str, master_port: int, job_id: str
                    ) -> DistIdentity:
    """One srun task per rank. The step's variables, not the job's: a step may use part of the allocation."""
    def step_or_job(step_name: str, job_name: str) -> str:
        return step_name if step_name in has else job_name

    tasks_name = step_or_job("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    nodes_name = step_or_job("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
    per_node_name = step_or_job("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    for name in (tasks_name, nodes_name, per_node_name, "SLURM_LOCALID"):
        if name not in has:
            raise LaunchEnvError(f"SLURM_PROCID is set but {name} is not: not a complete srun environment; {SRUN_HINT}")
    world_size = _int(env, tasks_name, "set by srun", minimum=1)
    rank = _int(env, "SLURM_PROCID", "set by srun")
    if rank >= world_size:
        raise LaunchEnvError(f"SLURM_PROCID={rank} is not below {tasks_name}={world_size}; ranks run from 0 to "
                             f"{world_size - 1}: do not set Slurm's variables by hand, {SRUN_HINT}")
    nodes = expand_hostlist(env[nodes_name])
    per_node = expand_counts(env[per_node_name])
    if len(per_node) != len(nodes) or sum(per_node) != world_size:
        raise LaunchEnvError(f"{per_node_name}={env[per_node_name]} does not give {tasks_name}={world_size} tasks "
                             f"on the {len(nodes)} node(s) of {nodes_name}={env[nodes_name]}; {SRUN_HINT}")
    node_name = env.get("SLURMD_NODENAME", "").strip()
    if node_name in nodes:
        node_rank = nodes.index(node_name)
    else:
        node_rank = _int(env, "SLURM_NODEID", "set by srun") if "SLURM_NODEID" in has else 0
        if node_rank >= len(nodes):
            raise LaunchEnvError(f"SLURM_NODEID={node_rank} but {nodes_name}={env[nodes_name]} has {len(nodes)} "
                                 f"node(s); {SRUN_HINT}")
    local_world_size = per_node[node_rank]
    local_rank = _int(env, "SLURM_LOCALID", "set by srun")
    if local_rank >= local_world_size:
        raise LaunchEnvError(f"SLURM_LOCALID={local_rank} is not below the {local_world_size} task(s) that "
                             f"{per_node_name}={env[per_node_name]} gives node {node_rank}; {SRUN_HINT}")
    master_addr, port = env.get("MASTER_ADDR", "").strip() or nodes[0], master_port
    if "MASTER_PORT" in has:
        port = _int(env, "MASTER_PORT", "set MASTER_PORT to the master's TCP port (1-65535)", minimum=1)
    elif not port:
        if "SLURM_JOB_ID" not in has:
            raise LaunchEnvError("SLURM_JOB_ID is not set, so no master port can be derived from it; set "
                                 "MASTER_PORT or --master-port")
        port = SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID", "set by Slurm") % SLURM_PORT_SPAN
    if port > 65535:
        raise LaunchEnvError(f"master port {port} is not a TCP port; set MASTER_PORT or --master-port to 1-65535")
    restart_count = _int(env, "SLURM_RESTART_COUNT", "set by Slurm") if "SLURM_RESTART_COUNT" in has else 0
    job, named = job_name(env, "slurm", host, master_addr, port, job_id)
    return DistIdentity(rank, local_rank, world_size, local_world_size, node_rank, len(nodes), master_addr, port,
                        "slurm", host, restart_count, job=job, job_named=named)
