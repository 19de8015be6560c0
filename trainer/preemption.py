"""Preemption: SIGTERM (Kubernetes eviction, docker stop, torchrun shutdown) becomes a checkpoint and a
retryable exit, agreed on by every rank at the same step boundary."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from trainer.distributed import Runtime, StopVote
from trainer.errors import EXIT_PREEMPTED

FORCED_EXIT_CLEANUP_S = 2.0


class PreemptionWatcher:
    """Records SIGTERM; ``should_stop`` asks every rank whether any of them got it (see StopVote).

    The grace period starts at the signal: if the checkpoint and exit have not happened by then,
    the process exits anyway with the same retryable code, before the launcher's SIGKILL; the
    previous checkpoint is still valid because saves are atomic.
    """

    def __init__(self, grace_period_s: float, runtime: Runtime, log: logging.Logger) -> None:
        self.grace_period_s = grace_period_s
        self.vote = StopVote(runtime)
        self.log = log
        self.signal_received: int | None = None
        # Run (for at most FORCED_EXIT_CLEANUP_S) before exiting without a checkpoint: the checkpoint
        # folder's lease is released, so the next job need not wait for it to expire.
        self.before_forced_exit: Callable[[], None] | None = None
        self._previous: dict[int, object] = {}
        self._deadline_timer: threading.Timer | None = None
        self._stopping_since: float | None = None  # time.monotonic() of the signal, or of the vote that told of one

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            # Signals reach only the main thread, and only it may set their handlers: here a launcher owns it (Ray
            # Train runs the training function in a thread of its worker) and stops the workers itself. A stop
            # then loses the steps since the last checkpoint, as a kill does (docs/ray.md).
            self.log.info("training runs outside the process's main thread: stop signals are the launcher's; "
                          "no checkpoint at SIGTERM")
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_received is not None:
            # A second signal is a person insisting (Ctrl-C twice): stop now; saves are atomic.
            self.log.error("second %s: exiting now without a new checkpoint", signal.Signals(signum).name)
            self._exit_now()
        self.signal_received = signum
        self._stopping_since = time.monotonic()
        self._deadline_timer = threading.Timer(self.grace_period_s, self._grace_period_over)
        self._deadline_timer.daemon = True
        self._deadline_timer.start()

    def _grace_period_over(self) -> None:
        self.log.error("grace period of %.0fs over before the checkpoint finished; exiting with %d, the previous "
                       "checkpoint stays valid", self.grace_period_s, EXIT_PREEMPTED)
        self._exit_now()

    def _exit_now(self) -> None:
        if self.before_forced_exit is not None:
            # In a thread of its own, bounded: the storage may be what hangs.
            cleanup = threading.Thread(target=self.before_forced_exit, name="forced-exit-cleanup", daemon=True)
            cleanup.start()
            cleanup.join(FORCED_EXIT_CLEANUP_S)
        logging.shutdown()
        os._exit(EXIT_PREEMPTED)

    def should_stop(self) -> bool:
        """A collective: call on every rank at every step. True, on every rank at the same step, one step after
        some rank's signal."""
        return self._stopping(self.vote(self.signal_received is not None))

    def should_stop_now(self) -> bool:
        """A collective: where training ends (every rank, same point), the last vote's outcome."""
        return self._stopping(self.vote.settle())

    def _stopping(self, stop: bool) -> bool:
        if stop and self._stopping_since is None:  # another rank's signal: the launcher's kill comes to all alike
            self._stopping_since = time.monotonic()
        return stop

    def exit_deadline(self) -> float | None:
        """When a stopping process must be done with everything (time.monotonic()): the grace period from the
        signal, less the forced exit's own cleanup time. None while no stop was asked for."""
        if self._stopping_since is None:
            return None
        return self._stopping_since + self.grace_period_s - FORCED_EXIT_CLEANUP_S

    def describe(self) -> str:
        if self.signal_received is None:
            return "another rank received a stop signal"
        return f"received {signal.Signals(self.signal_received).name}"


def ignore_stop_signals_in_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: the launcher signals the whole process group, and a worker that dies
    first takes the batch the preemption checkpoint is waiting for with it. The main process ends the
    workers itself once the checkpoint is written (and they exit on their own if it dies)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
