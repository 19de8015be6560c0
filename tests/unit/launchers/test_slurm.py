"""The Slurm dialects (tasks, torchrun under Slurm, the batch script), as srun and sbatch set them
(captured from the CI cluster: Slurm 22.05, two nodes)."""

from __future__ import annotations

import pytest
import torch

from trainer.config import DistConfig
from trainer.distributed import choose_device
from trainer.errors import LaunchEnvError
from trainer.launchers import identity_from_env, without_launcher_variables
from trainer.launchers.hostlist import expand_counts, expand_hostlist

# What the batch script of `sbatch -N2 -n4` sees (the job's variables, no step).
BATCH = {
    "SLURMD_NODENAME": "n1", "SLURM_CLUSTER_NAME": "ci", "SLURM_CPUS_ON_NODE": "2", "SLURM_GTIDS": "0",
    "SLURM_JOBID": "1", "SLURM_JOB_CPUS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
    "SLURM_NODELIST": "n[1-2]", "SLURM_NPROCS": "4", "SLURM_NTASKS": "4", "SLURM_PROCID": "0",
    "SLURM_SUBMIT_DIR": "/tmp/sl", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_TOPOLOGY_ADDR": "n1",
}
# Task 1 of `srun` in that script: the step's variables on top.
TASK_1 = {
    **BATCH, "SLURM_DISTRIBUTION": "block", "SLURM_GTIDS": "0,1", "SLURM_LOCALID": "1", "SLURM_PROCID": "1",
    "SLURM_STEPID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


def task(procid: int, node: str, localid: int, **changes: str) -> dict[str, str]:
    return {**TASK_1, "SLURM_PROCID": str(procid), "SLURMD_NODENAME": node, "SLURM_NODEID": node[1:],
            "SLURM_LOCALID": str(localid), **changes}


def test_each_srun_task_is_a_rank_with_the_first_node_as_master_and_a_port_from_the_job_id():
    identities = [identity_from_env(task(rank, f"n{1 + rank // 2}", rank % 2), hostname="vm") for rank in range(4)]
    assert [(i.rank, i.local_rank, i.node_rank) for i in identities] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    for identity in identities:
        assert (identity.world_size, identity.local_world_size, identity.num_nodes) == (4, 2, 2)
        assert (identity.master_addr, identity.master_port, identity.launcher) == ("n1", 20001, "slurm")
        assert identity.restart_count == 0
    assert identities[0].is_main and identities[2].is_local_main and not identities[3].is_local_main


def test_the_step_wins_over_the_job_a_requeue_is_counted_and_the_port_can_be_named():
    # `srun -n2` on the second node of a 4-task job: the step has 2 tasks; its master is the step's first node.
    env = task(1, "n2", 1, SLURM_STEP_NODELIST="n2", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2",
               SLURM_STEP_NUM_NODES="1", SLURM_JOB_ID="123456", SLURM_RESTART_COUNT="2")
    identity = identity_from_env(env, hostname="vm")
    assert (identity.rank, identity.world_size, identity.node_rank, identity.num_nodes) == (1, 2, 0, 1)
    assert (identity.master_addr, identity.master_port, identity.restart_count) == ("n2", 23456, 2)
    assert identity.job == "slurm-job-ci-123456.0", "a requeued job keeps its id (on its cluster) and step numbers"
    assert identity_from_env(env, master_port=31000).master_port == 31000
    named = identity_from_env({**env, "MASTER_ADDR": "n2-ib", "MASTER_PORT": "29500"}, master_port=31000)
    assert (named.master_addr, named.master_port) == ("n2-ib", 29500), "the environment wins over the flag"


def test_the_batch_script_itself_is_not_rank_0_of_the_job():
    with pytest.raises(LaunchEnvError) as caught:
        identity_from_env(BATCH)
    assert str(caught.value) == (
        "SLURM_NTASKS=4 but this process runs in the batch script itself, not in an srun step, so it would train "
        "alone as rank 0 of 4 and wait for the rest; start one task per rank with srun (srun python -m trainer "
        "...), or one torchrun per node (see slurm/train.sbatch)")
    one_task = identity_from_env({**BATCH, "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"})
    assert one_task.launcher == "single-process", "a one-task job may train in its batch script"


@pytest.mark.parametrize(("changes", "message"), [
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is not below SLURM_STEP_NUM_TASKS=4; ranks run from 0 to 3"),
    ({"SLURM_PROCID": "one"}, "SLURM_PROCID='one' is not an integer; set by srun"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,2"}, "SLURM_STEP_TASKS_PER_NODE=3,2 does not give SLURM_STEP_NUM_TASKS=4 "
                                           "tasks on the 2 node(s) of SLURM_STEP_NODELIST=n[1-2]"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 is not below the 2 task(s) that SLURM_STEP_TASKS_PER_NODE=2(x2) "
                             "gives node 0"),
    ({"SLURM_STEP_NODELIST": "n[2-1]"}, "the range '2-1' in the host list 'n[2-1]' runs backwards"),
    ({"SLURM_STEP_NODELIST": "n[1-2"}, "unbalanced brackets in the host list 'n[1-2'"),
    ({"MASTER_PORT": "70000"}, "master port 70000 is not a TCP port"),
    ({"SLURM_LOCALID": ""}, "SLURM_PROCID is set but SLURM_LOCALID is not: not a complete srun environment"),
])
def test_inconsistent_slurm_variables_are_one_clear_error(changes, message):
    with pytest.raises(LaunchEnvError) as caught:
        identity_from_env({**TASK_1, **changes})
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_process_started_from_a_slurm_task_inherits_no_place_in_its_group():
    assert without_launcher_variables({**TASK_1, "PATH": "/bin", "SLURM_RESTART_COUNT": "1"}) == {"PATH": "/bin"}


def test_a_gpu_bound_to_each_task_is_device_0_and_otherwise_the_local_rank():
    identity = identity_from_env(task(1, "n1", 1))
    assert choose_device(DistConfig(device="cuda"), identity, cuda_count=1) == torch.device("cuda", 0)
    assert choose_device(DistConfig(device="cuda"), identity, cuda_count=2) == torch.device("cuda", 1)


@pytest.mark.parametrize(("text", "hosts"), [
    ("n[1-2]", ["n1", "n2"]),
    ("vm", ["vm"]),
    ("node[01-03,07],gpu-a[9-11]", ["node01", "node02", "node03", "node07", "gpu-a9", "gpu-a10", "gpu-a11"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a1,b[3],c", ["a1", "b3", "c"]),
])
def test_host_lists_expand_in_slurms_order(text, hosts):
    assert expand_hostlist(text) == hosts


def test_per_node_counts_expand():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(LaunchEnvError, match=r"'2\(3\)' in the per-node counts"):
        expand_counts("2(3)")


def test_rank_and_world_size_exported_inside_srun_leave_slurm_to_place_each_task():
    """`export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS` (an sbatch idiom) must not make every task local rank
    0 on cuda:0 with a job named by the first node (another job after a requeue elsewhere)."""
    exported = task(3, "n2", 1, RANK="3", WORLD_SIZE="4", MASTER_ADDR="n1", MASTER_PORT="29400")
    identity = identity_from_env(exported, hostname="n2")
    assert (identity.launcher, identity.rank, identity.local_rank, identity.local_world_size) == ("slurm", 3, 1, 2)
    assert identity.job == "slurm-job-ci-1.0"
    with pytest.raises(LaunchEnvError, match=r"^RANK=0 but SLURM_PROCID=3; unset RANK"):
        identity_from_env({**exported, "RANK": "0"})
    # With LOCAL_RANK too, the user places the processes (the plain dialect), and the job is still Slurm's.
    placed = identity_from_env({**exported, "LOCAL_RANK": "0"}, hostname="n2")
    assert (placed.launcher, placed.local_rank, placed.job) == ("env", 0, "slurm-job-ci-1.0")


def test_two_srun_steps_of_one_allocation_are_two_jobs_and_a_requeue_is_the_same_one():
    """Concurrent sruns, or runs in an interactive salloc, share SLURM_JOB_ID: each step is its own job (it must
    not take another's live lease as its own earlier attempt); a requeue numbers its steps from 0 again."""
    first, second = (identity_from_env(task(0, "n1", 0, SLURM_STEP_ID=step, SLURM_STEPID=step)) for step in "01")
    assert (first.job, second.job) == ("slurm-job-ci-1.0", "slurm-job-ci-1.1")
    requeued = identity_from_env(task(0, "n1", 0, SLURM_RESTART_COUNT="1"))
    assert requeued.job == first.job and requeued.restart_count == 1


def test_slurms_special_steps_are_not_srun_tasks_and_a_random_torchrun_id_is_no_part_of_the_job():
    """Slurm >= 20.11 sets SLURM_STEP_ID=-5 in the batch script (-4 extern, -6 an interactive salloc): the batch
    script of a 4-task job is still refused, and plain variables there are the plain dialect's."""
    for special in ("-5", "4294967291", "-6"):
        batch = {**BATCH, "SLURM_STEP_ID": special}
        with pytest.raises(LaunchEnvError, match="runs in the batch script itself"):
            identity_from_env(batch)
        plain = identity_from_env({**batch, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "n1",
                                   "MASTER_PORT": "29500"}, hostname="n1", boot_id="")
        assert (plain.launcher, plain.rank, plain.job) == ("env", 1, "env@n1:29500")
    standalone = {**TASK_1, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "n1", "MASTER_PORT": "29400",
                  "TORCHELASTIC_RUN_ID": "5c1b0a3e-7d7b-4a8a-9b7c-2f1d9e6c4b10"}  # --standalone's uuid
    assert identity_from_env(standalone).job == "slurm-job-ci-1.0", "a requeue's new uuid: the same job"
