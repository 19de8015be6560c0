"""The trainer's path flags as every worker will read them.

The driver checks the flags against its own working folder; each worker runs on its own node, started by Ray in
the job's --working-dir (``ray job submit --working-dir .``: unpacked on every node) or, without one, wherever Ray
starts workers. So, before the flags travel:

- without a job working dir, a relative path becomes absolute against the driver's folder (a shared mount at the
  same path then works, and a folder that is the driver's alone fails on the worker, naming the path);
- with one, input paths stay relative: each worker starts in its node's copy of the working dir, where they point
  at the same files (Ray Train's move of the workers into a node-local folder is turned off:
  ray_internals.workers_keep_their_folder). An output path (--checkpoint-dir, --output-dir) inside the working dir
  is refused: each node's copy is its own, and checkpoints written there would be one node's alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from trainer.on_ray.settings import RayLaunchError

__all__ = ["INPUTS", "OUTPUTS", "as_workers_read_them", "checkpoint_location"]

INPUTS = ("--config", "--data-dir", "--init-from", "--resume")
OUTPUTS = ("--checkpoint-dir", "--output-dir")
NOT_PATHS = {"--resume": ("latest", "none")}  # values of a path flag that are words, not paths


def _relative(value: str) -> bool:
    return bool(value) and "://" not in value and not value.startswith("/")  # "~": expanded before


def as_workers_read_them(argv: Sequence[str], driver_folder: str, job_working_dir: bool) -> list[str]:
    """``argv`` with each relative path flag made absolute (no job working dir) or checked (a job working dir)."""
    out: list[str] = []
    pending: str | None = None  # a flag whose value is the next argument
    for argument in argv:
        if pending is not None:
            out.append(_rewritten(pending, argument, driver_folder, job_working_dir))
            pending = None
            continue
        flag, equals, value = argument.partition("=")
        if flag in INPUTS + OUTPUTS:
            if equals:
                out.append(f"{flag}={_rewritten(flag, value, driver_folder, job_working_dir)}")
            else:
                out.append(argument)
                pending = flag
            continue
        out.append(argument)
    return out


def checkpoint_location(location: str, driver_folder: str, job_working_dir: bool) -> str:
    """Where the checkpoints go as every worker reads it (a config file's --checkpoint-dir included)."""
    return _rewritten("--checkpoint-dir", location, driver_folder, job_working_dir)


def _rewritten(flag: str, value: str, driver_folder: str, job_working_dir: bool) -> str:
    if value.startswith("~"):
        return os.path.expanduser(value)  # the driver's home: nothing on the workers' side would expand it
    if not _relative(value) or value in NOT_PATHS.get(flag, ()):
        return value
    if not job_working_dir:
        return os.path.join(driver_folder, value)
    if flag in OUTPUTS:
        raise RayLaunchError(f"{flag} {value}: a relative path is inside the job's --working-dir, which each node "
                             f"unpacks for itself, so what is written there is one node's alone; give a folder every "
                             f"node mounts (an absolute path) or an object store (s3://...)")
    return value
