"""How Ray runs the trainer (``RayRun``): the workers, the run's name and folder, the cluster."""

from __future__ import annotations

import math
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.errors import UserError

__all__ = ["RayLaunchError", "RayRun", "new_run_name"]


class RayLaunchError(UserError):
    """A Ray run that cannot start: the cluster, its capacity, or the run's folder."""


def new_run_name() -> str:
    """A name no earlier run has (Ray's own default is unique per run too): a fixed default would resume whatever
    run last had it, with that run's settings, or train nothing if it had finished."""
    return f"ddp-train-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class RayRun:
    """How Ray runs the trainer: the workers (ScalingConfig), the run (RunConfig) and the cluster."""

    num_workers: tuple[int, int] = (1, 1)  # (min, max): equal for a fixed size; otherwise Ray resizes within it
    # RunConfig(name): the same name resumes the run (after a driver crash, say); a new one each time by default.
    name: str = field(default_factory=new_run_name)
    storage_path: str = "~/ray_results"  # RunConfig(storage_path): a folder every worker reaches (checked)
    address: str | None = None  # ray.init(address): None joins a running local cluster or starts one
    use_gpu: bool = False  # one GPU per worker (NCCL)
    cpus_per_worker: float = 1.0
    max_failures: int = 3  # FailureConfig(max_failures): worker-group restarts after failures
    # An elastic run: how often Ray looks for room to grow (ScalingConfig's elastic_resize_monitor_interval_s).
    resize_check_s: float = 60.0
    cluster_autoscales: bool = False  # workers that do not fit now may fit later: do not refuse them at the start

    @property
    def folder(self) -> str:
        """The run's folder: Ray's RunConfig storage path and name, the trainer's --output-dir."""
        return str(Path(os.path.expanduser(self.storage_path)).absolute() / self.name)

    def check(self) -> None:
        """What the command line's types check, for the Python form too."""
        low, high = self.num_workers
        problems = [(not 1 <= low <= high, f"num_workers {self.num_workers}: need 1 <= MIN <= MAX"),
                    (not (math.isfinite(self.cpus_per_worker) and self.cpus_per_worker > 0),
                     f"cpus_per_worker {self.cpus_per_worker}: need a number above 0"),
                    (not (math.isfinite(self.resize_check_s) and self.resize_check_s > 0),
                     f"resize_check_s {self.resize_check_s}: need a number above 0"),
                    (self.max_failures < -1, f"max_failures {self.max_failures}: need -1 (no limit) or more")]
        for wrong, message in problems:
            if wrong:
                raise RayLaunchError(f"RayRun {message}")
        if "://" in self.storage_path:
            raise RayLaunchError(f"--ray-storage-path {self.storage_path}: Ray's run folder must be a folder every "
                                 f"worker mounts (NFS, a shared volume) under ddp-train-ray; the checkpoints "
                                 f"themselves may go to an object store (--checkpoint-dir s3://...)")
        if self.name in ("", ".", "..") or "/" in self.name or os.sep in self.name:
            raise RayLaunchError(f"--ray-run-name {self.name!r}: a run's name is one folder name (no '/', not '.' "
                                 f"or '..'), its folder STORAGE_PATH/NAME; put any hierarchy in --ray-storage-path")

    @property
    def workers_text(self) -> str:
        low, high = self.num_workers
        return str(low) if low == high else f"{low}:{high}"
