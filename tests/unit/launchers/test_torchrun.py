"""torchrun's variables (TorchX, Compose and TrainJobs run torchrun too)."""

from __future__ import annotations

import os

from trainer.launchers import identity_from_env

TORCHRUN_NODE1_RANK3 = {
    "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "MASTER_ADDR": "node0", "MASTER_PORT": "41231",
    "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0",
}


def test_torchrun_variables_give_process_node_and_local_ranks():
    identity = identity_from_env(TORCHRUN_NODE1_RANK3, hostname="h")
    assert identity.rank == 3 and identity.local_rank == 1 and identity.world_size == 4
    assert identity.local_world_size == 2 and identity.node_rank == 1 and identity.num_nodes == 2
    assert (identity.master_addr, identity.master_port) == ("node0", 41231)
    assert identity.launcher == "torchrun" and not identity.is_main and not identity.is_local_main


def test_a_loopback_rendezvous_names_no_job_so_two_machines_jobs_are_never_taken_for_each_other():
    """torchrun without --standalone or --rdzv-id (static rendezvous, 127.0.0.1:29500) is the same on every host."""
    static = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}
    first, second = identity_from_env(static, hostname="host-a"), identity_from_env(static, hostname="host-b")
    assert first.job != second.job and not first.job_named and not second.job_named
    assert first.job == f"torchrun-agent-host-a-{os.getppid()}"  # the agent: kept across torchrun's restarts
    assert first.job == identity_from_env(static, hostname="host-a").job
    by_hand = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
    assert identity_from_env(by_hand, hostname="host-a").job == f"env-host-a-{os.getpid()}"
    for loopback in ("127.0.0.2", "::1", "[::1]"):
        assert not identity_from_env({**static, "MASTER_ADDR": loopback}).job_named
    named = identity_from_env(static, hostname="host-a", job_id="nightly")
    assert (named.job, named.job_named) == ("nightly", True)
    assert identity_from_env({**static, "MASTER_ADDR": "10.0.0.5"}).job_named  # other hosts reach it: a name


def test_workers_know_how_many_more_times_their_agent_restarts_them():
    """torchrun with --max-restarts above 0 starts its workers again itself (CheckpointManager.release_lease)."""
    assert identity_from_env(TORCHRUN_NODE1_RANK3).restarts_left is None  # no TORCHELASTIC_MAX_RESTARTS: never
    assert identity_from_env({**TORCHRUN_NODE1_RANK3, "TORCHELASTIC_MAX_RESTARTS": "0"}).restarts_left is None
    attempts = {**TORCHRUN_NODE1_RANK3, "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert identity_from_env(attempts).restarts_left == 3
    assert identity_from_env({**attempts, "TORCHELASTIC_RESTART_COUNT": "3"}).restarts_left == 0  # the last one
