"""Errors meant for people, and the exit codes the launchers see.

Exit codes are chosen for Kubeflow's ``restartPolicy: ExitCode``, which retries
codes 128-255 and fails permanently on 1-127: a bad configuration must not be
retried forever, a preemption must be.
"""

from __future__ import annotations

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_PEER_LOST", "EXIT_PREEMPTED", "EXIT_RENDEZVOUS", "EXIT_USAGE",
           "CheckpointError", "ConfigError", "DataError", "DataUnavailable",
           "DeviceError", "LaunchEnvError", "OutOfMemory", "PeerLost",
           "Preempted", "RendezvousError", "StorageStalled", "StorageUnavailable", "TaskError", "TrackerError",
           "UserError", "described",
           "first_line"]

EXIT_OK = 0
EXIT_FAILURE = 1  # an unexpected error: a bug, a traceback is printed
EXIT_USAGE = 2  # bad flags, environment, data or checkpoint: fix the input, do not retry
EXIT_RENDEZVOUS = 3  # the master could not be reached before the deadline
EXIT_PREEMPTED = 143  # SIGTERM received, checkpoint written: retry (128 + SIGTERM, as Kubernetes reports it)
EXIT_PEER_LOST = 200  # a rank died or vanished, or the storage kept failing: retry from the last checkpoint


def first_line(error: BaseException) -> str:
    """The first line of an error's message (collective and store errors run to pages), or its type."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def described(error: BaseException) -> str:
    """``Type: first line``, for errors that come from code a person wrote (a task, a dataset)."""
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def user_message(error: UserError) -> str:
    """The message of a UserError, also when a DataLoader worker raised it: the DataLoader re-raises it in
    the main process with the worker's traceback as the message, and the last line is the original one."""
    text = str(error).strip()
    if "Original Traceback" not in text:
        return text
    last = text.splitlines()[-1]  # "trainer.errors.DataError: the message"
    name, _, message = last.partition(": ")
    return message if name.rsplit(".", 1)[-1] == type(error).__name__ else last


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


class DataUnavailable(DataError):
    """The data's store kept failing past the retries (throttling, 5xx, dropped connections): nothing is wrong
    with the data, so the job ends to be restarted from its last checkpoint, not failed for good."""

    exit_code = EXIT_PEER_LOST


class CheckpointError(UserError):
    """A checkpoint cannot be written or the requested one cannot be loaded."""


class OutputError(UserError):
    """A run's own output (metrics, TensorBoard, config.yaml, summary.json) cannot be written."""


class DeviceError(UserError):
    """The requested device or backend does not exist on this machine."""


class TaskError(UserError):
    """The user's task cannot be imported, lacks a part, or one of its parts failed."""


class TrackerError(UserError):
    """An experiment tracker (--tracker) cannot be reached or refuses the run at start; once the run is going,
    a tracker's failure is a warning, never an error (trainer.tracking)."""


class OutOfMemory(UserError):
    """A rank ran out of device memory: the batch, precision or sharding must change; a retry would fail again."""


class PeerLost(UserError):
    """Another rank stopped responding or a collective timed out: retried from the last checkpoint."""

    exit_code = EXIT_PEER_LOST


class StorageStalled(CheckpointError):
    """A checkpoint write outlasted --checkpoint-timeout-s (a hung mount or bucket): the job ends to be
    restarted, and resumes from the last complete checkpoint."""

    exit_code = EXIT_PEER_LOST


class StorageUnavailable(CheckpointError):
    """The checkpoint storage failed in a way a retry may fix (an I/O error, throttling, a 5xx, a dropped
    connection) for longer than the run allows (--max-failed-saves in a row, or the final save's retries): the job
    ends to be restarted, and resumes from the last committed checkpoint, which is intact."""

    exit_code = EXIT_PEER_LOST


class Preempted(Exception):
    """Raised after the preemption checkpoint is written, to unwind to the exit."""
