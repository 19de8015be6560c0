"""--checkpoint-every-s: a save once enough time has passed since the last one, at a step every rank agrees on.

A step-count interval bounds the work a lost node costs in steps, which is seconds only while a step's time is
known and steady; this bounds it in seconds. Ranks' clocks differ, so the decision is a vote (the same
asynchronous one as a stop's, trainer.distributed.StopVote): due on every rank at the same step, one step after
the first rank whose clock passed the interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from trainer.distributed import Runtime, StopVote


class TimedSaves:
    def __init__(self, every_s: float, runtime: Runtime, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self.vote = StopVote(runtime) if every_s > 0 else None  # off: no collective at all
        self._last_save = clock()
        # The vote in flight when a save happens was cast before it: its outcome is stale, on every rank alike
        # (every rank saves at the same step).
        self._next_is_stale = False

    def due(self) -> bool:
        """A collective while on: call on every rank after every optimizer step."""
        if self.vote is None:
            return False
        due = self.vote(self.clock() - self._last_save >= self.every_s)
        if self._next_is_stale:
            self._next_is_stale = False
            return False
        return due

    def saved(self) -> None:
        """A checkpoint was written (whatever asked for it), on every rank at this step: the interval starts again."""
        self._last_save = self.clock()
        # One process votes with itself, at once: nothing is in flight.
        self._next_is_stale = self.vote is not None and self.vote.group is not None

    def settle(self) -> None:
        """Where the training loop ends (every rank, same point): no vote left in flight."""
        if self.vote is not None:
            self.vote.settle()
            self._next_is_stale = False
