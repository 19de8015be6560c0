"""Ray's training function, in each worker: the trainer's run, its checkpoints reported to Ray as they commit."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from trainer.api import run
from trainer.checkpoint import Committed, open_storage
from trainer.checkpoint.storage import MANIFEST
from trainer.errors import EXIT_OK, EXIT_USAGE
from trainer.launchers.ray_train import RAY_RUN_VARIABLE
from trainer.on_ray.drain import stop_when_this_node_drains
from trainer.on_ray.pointers import pointer_target, write_pointer
from trainer.on_ray.shared_storage import check_this_node
from trainer.preemption import StopRequests
from trainer.redact import redact

__all__ = ["has_committed", "report_to_ray", "train_in_worker"]


def train_in_worker(spec: dict[str, Any]) -> None:
    """A non-zero exit is a failure Ray restarts the worker group for (FailureConfig)."""
    if spec.get("markers") is not None:
        check_this_node(spec["markers"])
    if not spec.get("job_working_dir") and os.path.isdir(spec.get("driver_folder") or ""):
        # Relative paths the flags do not name (a YAML config's, a task's own options) mean what they meant to the
        # driver where its folder is here too; in a job's --working-dir the worker already is in its node's copy.
        os.chdir(spec["driver_folder"])
    os.environ[RAY_RUN_VARIABLE] = spec["run"]
    argv = [*spec["argv"], *_resume_where_the_run_left_off(spec["checkpoints"])]
    requests = StopRequests()  # this node drained: a checkpoint at the next step, then EXIT_PREEMPTED (drain.py)
    with stop_when_this_node_drains(requests):
        code = run(spec["task"], argv, on_commit=functools.partial(report_to_ray, spec["run"]),
                   stop_requests=requests, **spec["settings"])
    if code != EXIT_OK:
        raise RuntimeError(f"the trainer exited with {code} on rank {os.environ.get('RANK', '?')}"
                           + (" (input to fix; see its log)" if code == EXIT_USAGE else ""))


def _resume_where_the_run_left_off(location: str) -> list[str]:
    """The flags a worker group adds once the run has checkpoints of its own (Ray restarted the group, or a driver
    started the run again: the driver refused a --resume that would not go on from them): --resume latest. Found
    in the checkpoint folder, not asked of Ray: a worker that dies moments after a report takes it with it before
    Ray's controller collects it, and Ray then knows of no checkpoint (seen here: a group killed at step 4 had
    reported step 2, and its restart got none from ray.train.get_checkpoint)."""
    import ray.train

    if not has_committed(location):
        return []
    if ray.train.get_context().get_world_rank() == 0:
        known = ray.train.get_checkpoint()
        told = f"Ray's last report named {pointer_target(known.path)}" if known else "Ray knows of none"
        print(redact(f"the run has checkpoints in {location} ({told}): the trainer resumes from its newest committed "
                     f"one (--resume latest)"), flush=True)
    return ["--resume", "latest"]


def has_committed(location: str) -> bool:
    """Whether the checkpoint folder holds a committed checkpoint (its manifest written): a save that never
    finished does not count, and the trainer removes it."""
    storage = open_storage(location)
    return any(MANIFEST in storage.files(name) for name in storage.list_checkpoints())


def report_to_ray(run_folder: str, committed: Committed) -> None:
    """on_commit under Ray: a barrier of every worker (ray.train.report), rank 0 reporting a pointer to the
    checkpoint."""
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    checkpoint = None
    if committed.location is not None:
        checkpoint = Checkpoint(str(write_pointer(Path(run_folder), committed.location, committed.step)))
    metrics = {"step": committed.step, "epoch": committed.epoch,
               **{name: float(value) for name, value in committed.metrics.items()}}
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
