"""Ray Train's workers, as ddp-train-ray starts them: Ray's torchrun-like variables and the run's folder."""

from __future__ import annotations

from trainer.launchers import identity_from_env, without_launcher_variables

# What Ray's TorchConfig sets in worker 1 of two on one node, and what trainer.on_ray's worker function adds.
RAY_WORKER = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0",
              "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "51234", "DDP_RAY_RUN": "/shared/runs/nightly"}


def test_a_ray_worker_is_read_as_ray_and_its_job_is_the_ray_run_whatever_worker_0s_address():
    identity = identity_from_env(RAY_WORKER, hostname="h")
    assert identity.launcher == "ray" and identity.rank == 1 and identity.local_rank == 1
    assert identity.world_size == 2 and identity.local_world_size == 2 and identity.node_rank == 0
    assert (identity.job, identity.job_named) == ("ray-run:/shared/runs/nightly", True)
    # Ray's next worker group listens elsewhere: the same run is the same job; another run is another.
    moved = identity_from_env({**RAY_WORKER, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "40001"}, hostname="g")
    assert moved.job == identity.job
    assert identity_from_env({**RAY_WORKER, "DDP_RAY_RUN": "/shared/runs/other"}).job != identity.job


def test_without_the_runs_folder_the_same_variables_are_torchruns_and_a_child_process_inherits_neither():
    others = {name: value for name, value in RAY_WORKER.items() if name != "DDP_RAY_RUN"}
    assert identity_from_env(others).launcher == "torchrun"
    assert without_launcher_variables({**RAY_WORKER, "HOME": "/root"}) == {"HOME": "/root"}
