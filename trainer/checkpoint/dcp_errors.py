"""What a DCP save or load across ranks says when it fails: one rank's error as every rank learns it, in one line.

DCP runs each save and load as collectives and sends a rank's exception to the others by pickling it: an error
is made plain before it goes (``plain``), and the failure DCP reports on every rank is read back as the lowest
failing rank's (``first_failure``). Where a run has no process group at all (ddp-export, a one-process run),
DCP's warning that it assumes one process is the intent, and is not shown (``quiet_when_alone``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.reading import InvalidCheckpoint, load_failure
from trainer.checkpoint.save_failures import is_transient

__all__ = ["RankFailed", "Relayed", "failure_line", "first_failure", "plain", "quiet_when_alone"]


class Relayed(RuntimeError):
    """Another rank's error as DCP relays it: its type's name and its words, in one line."""


class RankFailed(Exception):
    """A DCP save that failed on some rank, as every rank learns it: which rank, and its error."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(rank, error)
        self.rank, self.error = rank, error


def plain(error: BaseException) -> Exception:
    """An error DCP can send to the other ranks (it pickles them): an OSError as its number and words, anything
    else as its one line."""
    if isinstance(error, InvalidCheckpoint | Relayed):
        return error
    if isinstance(error, OSError):
        relayed: Exception = OSError(error.errno, str(error.strerror or error))
    else:
        relayed = Relayed(f"{type(error).__name__}: {' '.join(str(error).split())[:300]}")
    # Whether a retry may fix it is decided here, on the rank that failed, where the error's type, code and cause
    # are known (an s3fs PermissionError has no errno): the attribute travels with the pickle.
    relayed.transient = is_transient(error)  # type: ignore[attr-defined]
    return relayed


def first_failure(failed: CheckpointException, rank: int) -> tuple[int, BaseException]:
    """DCP reports every rank's failure at once, each with its traceback: the lowest rank's error is the one to
    say (``rank``'s own when the report names none)."""
    failures = failed.failures or {}
    if not failures:
        return rank, failed
    lowest = min(failures)
    error, _ = failures[lowest]
    return lowest, error


def failure_line(failed: CheckpointException) -> str:
    """A failed DCP load in one line: the reader's own message, or the first failing rank's error."""
    rank, error = first_failure(failed, 0)
    if isinstance(error, InvalidCheckpoint):
        return str(error)
    return f"rank {rank} could not read its part of the checkpoint ({load_failure(error)})"  # type: ignore[arg-type]


@contextlib.contextmanager
def quiet_when_alone(alone: bool) -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: here that is the intent (ddp-export,
    a one-process run). The warnings filter is the process's: touched only then."""
    if not alone:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
