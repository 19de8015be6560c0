"""Who this process is: every launcher's environment normalised into one typed value.

This package is the only place that reads launcher variables. One module per dialect, each a ``Launcher``
(``base``); ``LAUNCHERS`` asks them in order and the first whose ``detect`` holds reads the identity. The
order puts the more specific first: Ray Train's workers (whose variables look like torchrun's) first,
torchrun's variables win over Slurm's (one torchrun per node under srun), a PyTorchJob's ``PET_*`` beside
``RANK`` mark it apart from plain variables, and a process that no dialect claims is a single process. A new
dialect is a module here and its place in ``LAUNCHERS`` (docs/architecture.md).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from trainer.launchers.base import LaunchEnv, Launcher, is_loopback, kernel_boot_id
from trainer.launchers.identity import DistIdentity
from trainer.launchers.plain import PlainEnvironment
from trainer.launchers.pytorchjob import PyTorchJob
from trainer.launchers.ray_train import RayTrain
from trainer.launchers.single import SingleProcess
from trainer.launchers.slurm import SlurmBatchScript, SlurmTasks
from trainer.launchers.slurm_torchrun import TorchrunUnderSlurm
from trainer.launchers.torchrun import ELASTIC_AGENT_ENV, Torchrun
from trainer.launchers.trainjob import StatusServer, TrainJob, status_server_from_env

__all__ = ["ELASTIC_AGENT_ENV", "LAUNCHERS", "LAUNCHER_PREFIXES", "LAUNCHER_VARIABLES", "DistIdentity", "LaunchEnv",
           "Launcher", "StatusServer", "identity_from_env", "is_loopback", "launcher_of", "status_server_from_env",
           "without_launcher_variables"]

LAUNCHERS: tuple[Launcher, ...] = (RayTrain(), TorchrunUnderSlurm(), Torchrun(), PyTorchJob(), PlainEnvironment(),
                                   SlurmTasks(), SlurmBatchScript(), TrainJob(), SingleProcess())

# Every variable a dialect reads (and --job-id's variable), and the prefixes of families of them.
LAUNCHER_VARIABLES = tuple(dict.fromkeys(name for launcher in LAUNCHERS for name in launcher.variables)) + (
    "DDP_JOB_ID",)
LAUNCHER_PREFIXES = tuple(dict.fromkeys(prefix for launcher in LAUNCHERS for prefix in launcher.prefixes))


def without_launcher_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """environ less every launcher variable: what a process that starts a new group should pass on."""
    return {name: value for name, value in environ.items()
            if name not in LAUNCHER_VARIABLES and not name.startswith(LAUNCHER_PREFIXES)}


def launcher_of(env: LaunchEnv) -> Launcher:
    """The first dialect in LAUNCHERS that detects this environment (the single process detects any)."""
    return next(launcher for launcher in LAUNCHERS if launcher.detect(env))


def identity_from_env(env: Mapping[str, str], hostname: str | None = None, master_port: int = 0,
                      job_id: str = "", boot_id: str | None = None) -> DistIdentity:
    """Read the launcher's variables into a DistIdentity; one clear error for each inconsistency.

    ``master_port``: the port to use where the launcher names none (Slurm; --master-port), 0 to derive it.
    ``job_id``: --job-id, the job's name for the checkpoint folder's lease (``DDP_JOB_ID`` otherwise).
    ``boot_id``: this host's kernel boot id (read from /proc where None)."""
    launch = LaunchEnv(env, hostname or socket.gethostname(), master_port, job_id,
                       kernel_boot_id() if boot_id is None else boot_id)
    return launcher_of(launch).identity(launch)
