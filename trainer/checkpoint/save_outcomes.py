"""How a save ended, as every rank learns it from rank 0, and what follows: committed; a failure a retry may fix,
tolerated for a periodic save up to --max-failed-saves in a row (a warning on every rank, training goes on) and
retried with backoff for the final one within its deadline (SaveRetry); anything else raised on every rank alike."""

from __future__ import annotations

import logging
import time

from trainer.checkpoint.save_failures import SaveFailure
from trainer.config import CheckpointConfig
from trainer.distributed import Runtime, broadcast_from_main
from trainer.errors import CheckpointError, PeerLost, StorageStalled, StorageUnavailable

# A final save that failed on a storage error is tried again after these pauses, within its deadline.
FINAL_SAVE_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0)


class SaveRetry(Exception):
    """A final save failed on a storage error and rank 0 chose to try again, on every rank, in ``delay_s``."""

    def __init__(self, message: str, delay_s: float) -> None:
        super().__init__(message)
        self.delay_s = delay_s


class SaveOutcomes:
    def __init__(self, config: CheckpointConfig, runtime: Runtime, log: logging.Logger) -> None:
        self.config = config
        self.runtime = runtime
        self.log = log
        self.failed_in_a_row = 0  # periodic saves that failed on a storage error since the last that committed
        self.final_deadline: float | None = None  # rank 0's time.monotonic() by which a final save must commit
        self._final_attempt = 0

    def settle(self, failure: SaveFailure | None, step: int, last_said: str) -> bool:
        """Every rank learns how the save of ``step`` ended, from rank 0 (``last_said``, rank 0's: the checkpoint a
        restart would resume from, in words); True if it committed. Failed on an error a retry cannot fix:
        CheckpointError (exit 2); stalled past --checkpoint-timeout-s: StorageStalled (exit 200); the ranks' reports
        lost: PeerLost (exit 200). Failed on a storage error a retry may fix: a periodic save is one warning on every
        rank and training goes on, up to --max-failed-saves in a row (then StorageUnavailable, exit 200, naming the
        last committed checkpoint); a final save raises SaveRetry while rank 0's deadline leaves time for another
        try."""
        self.runtime.wait_for_all("rank 0's checkpoint work")
        retry_s = None
        if self.runtime.is_main and failure is not None and failure.transient and self.final_deadline is not None:
            retry_s = self._final_retry_delay()
        failure, last_said, retry_s = broadcast_from_main((failure, last_said, retry_s), self.runtime)
        if failure is None:
            self.failed_in_a_row = 0
            self._final_attempt = 0
            return True
        said = failure.message  # rank 0's, or one that names the rank it came from
        if not self.runtime.is_main and not said.startswith("rank "):
            said = f"rank 0 could not write the checkpoint: {said}"
        if failure.stalled:
            raise StorageStalled(said)
        if failure.peer_lost:
            raise PeerLost(said)
        if not failure.transient:
            raise CheckpointError(said)
        if self.final_deadline is not None:
            if retry_s is not None:
                raise SaveRetry(f"the final checkpoint at step {step} was not saved: {said}; trying again in "
                                f"{retry_s:g}s", retry_s)
            raise StorageUnavailable(f"the final checkpoint at step {step} was not saved, retried until its deadline: "
                                     f"{said}. {last_said}; the job ends to be restarted from it")
        self.failed_in_a_row += 1
        allowed = self.config.max_failed_saves
        if self.failed_in_a_row >= allowed:
            raise StorageUnavailable(f"{self.failed_in_a_row} checkpoint save(s) in a row failed (--max-failed-saves "
                                     f"{allowed}), the last at step {step}: {said}. {last_said}; the job ends to be "
                                     f"restarted from it")
        self.log.warning("checkpoint at step %d not saved (%d of --max-failed-saves %d in a row): %s. Training goes "
                         "on; the next save tries again. %s", step, self.failed_in_a_row, allowed, said, last_said)
        return False

    def _final_retry_delay(self) -> float | None:
        """On rank 0: the pause before a failed final save's next try, or None if its deadline leaves no time."""
        assert self.final_deadline is not None
        delay = FINAL_SAVE_BACKOFF_S[min(self._final_attempt, len(FINAL_SAVE_BACKOFF_S) - 1)]
        if time.monotonic() + delay >= self.final_deadline:
            return None
        self._final_attempt += 1
        return delay
