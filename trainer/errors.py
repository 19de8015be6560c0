"""Errors meant for people, and the exit codes the launchers see.

Exit codes are chosen for Kubeflow's ``restartPolicy: ExitCode``, which retries
codes 128-255 and fails permanently on 1-127: a bad configuration must not be
retried forever, a preemption must be.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1  # an unexpected error: a bug, a traceback is printed
EXIT_USAGE = 2  # bad flags, environment, data or checkpoint: fix the input, do not retry
EXIT_RENDEZVOUS = 3  # the master could not be reached before the deadline
EXIT_PREEMPTED = 143  # SIGTERM received, checkpoint written: retry (128 + SIGTERM, as Kubernetes reports it)
EXIT_PEER_LOST = 200  # another rank died or vanished mid-training: retry from the last checkpoint


def first_line(error: BaseException) -> str:
    """The first line of an error's message (collective and store errors run to pages), or its type."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class UserError(Exception):
    """A problem with the input that a person can fix; printed as one line, no traceback."""

    exit_code = EXIT_USAGE


class ConfigError(UserError):
    """A flag, config file value or their combination is invalid."""


class LaunchEnvError(UserError):
    """The launcher's environment variables are missing or inconsistent."""


class RendezvousError(UserError):
    """The master address never became reachable."""

    exit_code = EXIT_RENDEZVOUS


class DataError(UserError):
    """The dataset is missing, corrupt or unreadable."""


class CheckpointError(UserError):
    """A checkpoint cannot be written or the requested one cannot be loaded."""


class DeviceError(UserError):
    """The requested device or backend does not exist on this machine."""


class Preempted(Exception):
    """Raised after the preemption checkpoint is written, to unwind to the exit."""
