"""Retries without progress end: each attempt of a job writes into the checkpoint folder's lease where it started,
what it committed and how it ended (trainer.checkpoint.lease_record.Holder); the next attempt of the same job
counts those before it, in a row, that failed or were killed without committing a checkpoint past their start, and
past --max-attempts-without-progress is refused (exit 2), so that a job failing the same way is not retried for
ever.

Progress is judged by the folder as well as by the record: the checkpoint the next attempt resumes from is newer
than the step the previous one started from (an asynchronous save settled only at the next save, or a kill before
the record was written, leave a record that says less than what committed)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import EXIT_OK, EXIT_PREEMPTED, EXIT_RENDEZVOUS, EXIT_USAGE

# Exits that are no failure of the attempt's own to count, nor progress: a bad input (no launcher should retry it)
# and a preemption (checkpoint written). They carry the count on.
NOT_COUNTED = frozenset({EXIT_USAGE, EXIT_RENDEZVOUS, EXIT_PREEMPTED})


@dataclass
class Attempt:
    """One attempt's progress, as its lease record holds it (-1: not known)."""

    start_step: int = -1  # the step it resumed from (0 for a fresh start), once it found it
    committed_step: int = -1  # the newest step it committed
    exit_code: int = -1  # how it ended: -1 while it runs, or where it was killed without an exit
    failure: str = ""  # its error's first line
    failed_in_a_row: int = 0  # the attempts before it, in a row, that failed without progress (itself not counted)
    restart_count: int = 0  # its launcher's count of restarts (torchrun's TORCHELASTIC_RESTART_COUNT)


def failures_before(previous: Attempt | None, resumed_step: int, restart_count: int) -> int:
    """How many attempts in a row before this one failed without progress, ``previous`` (the same job's attempt
    just before, None for another job's or none) included. ``resumed_step``: where this attempt resumes (0:
    fresh; -1 not yet known). One that ended before it knew where it resumed (its start -1) made no progress. A
    preemption (143) counts as a failure where the launcher restarted its workers after one: torchrun stops every
    rank with SIGTERM when any rank fails, and counts a restart only then (a membership change is no restart)."""
    if previous is None or previous.exit_code == EXIT_OK:
        return 0
    if (previous.start_step >= 0 and resumed_step > previous.start_step) or \
            previous.committed_step > previous.start_step:
        return 0  # it committed past its start (seen in the folder, or in its record)
    if previous.exit_code == EXIT_PREEMPTED and restart_count > previous.restart_count:
        return previous.failed_in_a_row + 1
    if previous.exit_code in NOT_COUNTED:
        return previous.failed_in_a_row
    return previous.failed_in_a_row + 1


def refusal(folder: str, job: str, previous: Attempt, failed: int, limit: int) -> str:
    """The one line a job gets when it is not retried again."""
    last = (f"exit {previous.exit_code}: {previous.failure}" if previous.exit_code >= 0 else
            "killed without an exit: out of memory (OOMKilled), or its node was lost")
    started = f"step {previous.start_step}" if previous.start_step >= 0 else "where it started"
    return (f"checkpoint folder {folder}: the last {failed} attempts of this job ({job}) ended without committing a "
            f"checkpoint past {started} (the last: {last}); it is not retried again (--max-attempts-without-progress "
            f"{limit}). Fix the cause, then start it once more with --max-attempts-without-progress 0")
