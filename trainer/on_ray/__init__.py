"""Ray Train as a launcher: ``ddp-train-ray`` and ``run_on_ray``, the trainer's run in every worker of a Ray Train
``TorchTrainer``.

Each Ray worker runs ``trainer.run``, the same code path as under any other launcher, with the trainer's own
process group: Ray places the workers and names worker 0's address and a free port on it (MASTER_ADDR,
MASTER_PORT), but does not join a group itself (``ray_internals.trainer_process_group``). The trainer's group is
the one it makes under every launcher: its backend choice, its --collective-timeout-s, the NCCL and
flight-recorder settings that must be in place before the group exists, and its liveness store.

The run's folder, ``STORAGE_PATH/NAME`` (Ray's ``RunConfig``), is the trainer's --output-dir by default. Each
checkpoint is reported to Ray as it commits, as a Checkpoint that points at it (``pointers``), not a copy of it. A
restarted worker group (after a failure, a resize of an elastic run, or the driver started again with the same
run name) resumes from the newest committed checkpoint at the exact sample where it stopped, for any number of
workers.

One job per module: ``settings`` (RayRun), ``driver`` (the run from the driver's side), ``cluster`` (reaching the
cluster, its capacity), ``paths`` (the trainer's path flags as the workers will read them), ``shared_storage``
(the run's folder seen by every node), ``driver_lock`` (one driver per run), ``worker`` (the training function in
each worker), ``drain`` (a worker's node drained: a checkpoint at the next step), ``pointers`` (Ray's checkpoints),
``ray_internals`` (the only module that touches Ray beyond its public training API), ``cli`` (``ddp-train-ray``).
"""

from trainer.on_ray.cli import main, ray_parser
from trainer.on_ray.driver import run_on_ray
from trainer.on_ray.settings import RayRun

__all__ = ["RayRun", "main", "ray_parser", "run_on_ray"]
