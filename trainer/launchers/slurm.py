"""Slurm, one task per rank (``srun python -m trainer``): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``, ``SLURMD_NODENAME``, ``SLURM_STEP_NODELIST`` (the master is
its first host), ``SLURM_JOB_ID`` (the port: 20000 + id mod 10000, unless ``MASTER_PORT`` or ``--master-port``
names one), ``SLURM_RESTART_COUNT``. Only inside an ``srun`` step (``SLURM_STEP_ID``): the batch script itself
also sees ``SLURM_PROCID=0`` and the job's task count, and is refused when the job has several tasks.
"""

from __future__ import annotations

import re

from trainer.errors import LaunchEnvError
from trainer.launchers.base import LaunchEnv, Launcher
from trainer.launchers.hostlist import expand_counts, expand_hostlist
from trainer.launchers.identity import DistIdentity

SRUN_HINT = ("start one task per rank with srun (srun python -m trainer ...), or one torchrun per node "
             "(see slurm/train.sbatch)")
# Slurm job ids map to ports 20000-29999: below Linux's ephemeral range (32768-), so no outgoing
# connection holds one, and two jobs sharing a node collide only when their ids are 10000 apart.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000


# Slurm's special steps, as setup_env prints them (%d of their 0xfffffffN ids): the batch script's (Slurm >= 20.11
# sets SLURM_STEP_ID=-5 there), the extern step, an interactive salloc's step. Not a task of an srun.
SPECIAL_STEPS = {"-4", "-5", "-6", str(0xFFFFFFFC), str(0xFFFFFFFB), str(0xFFFFFFFA), "batch", "extern",
                 "interactive"}
# torchrun --standalone (and a single node without an endpoint) names each launch with a new uuid: not a name a
# requeue keeps, so not part of the job's.
RANDOM_RUN_ID = re.compile(r"^[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}$")


def in_srun_step(env: LaunchEnv) -> bool:
    """A task of an srun step (the batch script itself has SLURM_PROCID=0 too, and no step id or a special one)."""
    return env.has("SLURM_STEP_ID", "SLURM_PROCID") and env.get("SLURM_STEP_ID") not in SPECIAL_STEPS


def slurm_job(env: LaunchEnv, run_id: str = "") -> tuple[str, bool]:
    """The job id (and the cluster's name), and the srun step inside it: kept by a requeue (its steps are
    numbered from 0 again), unique on a cluster; two steps of one allocation (concurrent sruns, an interactive
    salloc's runs) are two jobs. ``run_id``: a torchrun's --rdzv-id, which tells torchrun apps of one
    allocation apart (left out where it is the job id, as slurm/train.sbatch passes it)."""
    cluster = env.get("SLURM_CLUSTER_NAME")
    job_id = env.get("SLURM_JOB_ID")
    name = f"slurm-job-{cluster + '-' if cluster else ''}{job_id}"
    if in_srun_step(env):
        name += f".{env.get('SLURM_STEP_ID')}"
    if run_id not in ("", "none", job_id) and not RANDOM_RUN_ID.match(run_id.lower()):
        name += f"-torchrun-{run_id}"
    return name, True


class SlurmTasks(Launcher):
    name = "slurm"
    variables = ("MASTER_ADDR", "MASTER_PORT")
    prefixes = ("SLURM_", "SLURMD_")

    def detect(self, env: LaunchEnv) -> bool:
        return in_srun_step(env)

    def identity(self, env: LaunchEnv) -> DistIdentity:
        """The step's variables, not the job's: a step may use part of the allocation. RANK and WORLD_SIZE
        exported beside them (without LOCAL_RANK: trainer.launchers.plain) must agree with Slurm's."""
        def step_or_job(step_name: str, job_name: str) -> str:
            return step_name if env.has(step_name) else job_name

        tasks_name = step_or_job("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        nodes_name = step_or_job("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
        per_node_name = step_or_job("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        for name in (tasks_name, nodes_name, per_node_name, "SLURM_LOCALID"):
            if not env.has(name):
                raise LaunchEnvError(f"SLURM_PROCID is set but {name} is not: not a complete srun environment; "
                                     f"{SRUN_HINT}")
        world_size = env.number(tasks_name, "set by srun", minimum=1)
        rank = env.number("SLURM_PROCID", "set by srun")
        if rank >= world_size:
            raise LaunchEnvError(f"SLURM_PROCID={rank} is not below {tasks_name}={world_size}; ranks run from 0 to "
                                 f"{world_size - 1}: do not set Slurm's variables by hand, {SRUN_HINT}")
        for name, value, source in (("RANK", rank, "SLURM_PROCID"), ("WORLD_SIZE", world_size, tasks_name)):
            if env.has(name) and env.get(name) != str(value):
                raise LaunchEnvError(f"{name}={env.get(name)} but {source}={value}; "
                                     f"unset {name} (the trainer reads Slurm's variables), or set LOCAL_RANK too to "
                                     f"place the processes yourself")
        nodes = expand_hostlist(env.variables[nodes_name])
        per_node = expand_counts(env.variables[per_node_name])
        if len(per_node) != len(nodes) or sum(per_node) != world_size:
            raise LaunchEnvError(f"{per_node_name}={env.variables[per_node_name]} does not give {tasks_name}="
                                 f"{world_size} tasks on the {len(nodes)} node(s) of {nodes_name}="
                                 f"{env.variables[nodes_name]}; {SRUN_HINT}")
        node_name = env.get("SLURMD_NODENAME")
        if node_name in nodes:
            node_rank = nodes.index(node_name)
        else:
            node_rank = env.number_or("SLURM_NODEID", 0, "set by srun")
            if node_rank >= len(nodes):
                raise LaunchEnvError(f"SLURM_NODEID={node_rank} but {nodes_name}={env.variables[nodes_name]} has "
                                     f"{len(nodes)} node(s); {SRUN_HINT}")
        local_world_size = per_node[node_rank]
        local_rank = env.number("SLURM_LOCALID", "set by srun")
        if local_rank >= local_world_size:
            raise LaunchEnvError(f"SLURM_LOCALID={local_rank} is not below the {local_world_size} task(s) that "
                                 f"{per_node_name}={env.variables[per_node_name]} gives node {node_rank}; {SRUN_HINT}")
        master = (env.get("MASTER_ADDR") or nodes[0], _master_port(env))
        return self.place(env, rank, local_rank, world_size, local_world_size, node_rank, len(nodes), master,
                          restart_count=env.number_or("SLURM_RESTART_COUNT", 0, "set by Slurm"),
                          may_hide_other_gpus=True)  # srun --gpus-per-task=1 shows each task its GPU as 0

    def job(self, env: LaunchEnv, master_addr: str, master_port: int) -> tuple[str, bool]:
        return slurm_job(env)


def _master_port(env: LaunchEnv) -> int:
    port = env.master_port
    if env.has("MASTER_PORT"):
        port = env.number("MASTER_PORT", "set MASTER_PORT to the master's TCP port (1-65535)", minimum=1)
    elif not port:
        if not env.has("SLURM_JOB_ID"):
            raise LaunchEnvError("SLURM_JOB_ID is not set, so no master port can be derived from it; set "
                                 "MASTER_PORT or --master-port")
        port = SLURM_PORT_BASE + env.number("SLURM_JOB_ID", "set by Slurm") % SLURM_PORT_SPAN
    if port > 65535:
        raise LaunchEnvError(f"master port {port} is not a TCP port; set MASTER_PORT or --master-port to 1-65535")
    return port


class SlurmBatchScript(Launcher):
    """The batch script itself, outside any srun step, in a job of several tasks: it would train alone as rank
    0 and wait for the rest. (A one-task job may train in its batch script: the single-process dialect.)"""

    name = "slurm-batch-script"
    prefixes = ("SLURM_",)

    def detect(self, env: LaunchEnv) -> bool:
        return (env.has("SLURM_JOB_ID", "SLURM_NTASKS") and not in_srun_step(env)
                and env.number("SLURM_NTASKS", "set by Slurm", minimum=1) > 1)

    def identity(self, env: LaunchEnv) -> DistIdentity:
        tasks = env.get("SLURM_NTASKS")
        raise LaunchEnvError(f"SLURM_NTASKS={tasks} but this process runs in the batch script itself, not in an "
                             f"srun step, so it would train alone as rank 0 of {tasks} and wait for the rest; "
                             f"{SRUN_HINT}")
