"""Preemption: SIGTERM (Kubernetes eviction, docker stop, torchrun shutdown), or a launcher's stop request (a Ray
node that drains: trainer.on_ray.drain), becomes a checkpoint and a retryable exit, agreed on by every rank at the
same step boundary."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from trainer.distributed import Runtime, StopVote
from trainer.errors import EXIT_PREEMPTED

FORCED_EXIT_CLEANUP_S = 2.0


@dataclass(frozen=True)
class StopRequest:
    """A stop asked for as SIGTERM asks for one, by something that is not a signal."""

    reason: str  # what the log says in place of "received SIGTERM": "node 1a2b3c is draining (deadline in 30 s)"
    exit_by: float | None = None  # time.monotonic() by which the process must be gone; None: --grace-period-s


class StopRequests:
    """Where a launcher asks the trainer to stop (``trainer.run(stop_requests=)``), from any thread, at any time.

    A request made before the run's PreemptionWatcher listens (the trainer still building) waits for it; the first
    request is the one that counts. The watcher stops listening as the run ends: a request after that is kept, for
    nobody.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: StopRequest | None = None
        self._listener: Callable[[StopRequest], None] | None = None

    def ask(self, request: StopRequest) -> None:
        with self._lock:
            if self._first is not None:
                return
            self._first, listener = request, self._listener
        if listener is not None:
            listener(request)

    def listen(self, listener: Callable[[StopRequest], None] | None) -> None:
        """``listener`` is told of the request, now if one was made already; None: nobody is, from now on."""
        with self._lock:
            self._listener, waiting = listener, self._first
        if listener is not None and waiting is not None:
            listener(waiting)


class PreemptionWatcher:
    """Records SIGTERM, or a launcher's StopRequest; ``should_stop`` asks every rank whether any of them got one
    (see StopVote).

    The grace period starts at the signal (or the request): if the checkpoint and exit have not happened by then,
    the process exits anyway with the same retryable code, before the launcher's SIGKILL; the previous checkpoint is
    still valid because saves are atomic. A request's grace period ends at its ``exit_by`` where that comes first
    (a drained node's deadline).
    """

    def __init__(self, grace_period_s: float, runtime: Runtime, log: logging.Logger,
                 requests: StopRequests | None = None) -> None:
        self.grace_period_s = grace_period_s
        self.vote = StopVote(runtime)
        self.log = log
        self.requests = requests
        self.signal_received: int | None = None
        self.request: StopRequest | None = None
        # Run (for at most FORCED_EXIT_CLEANUP_S) before exiting without a checkpoint: the checkpoint
        # folder's lease is released, so the next job need not wait for it to expire.
        self.before_forced_exit: Callable[[], None] | None = None
        self._previous: dict[int, object] = {}
        self._deadline_timer: threading.Timer | None = None
        self._stopping_since: float | None = None  # time.monotonic() of the signal, or of the vote that told of one
        self._grace_s = grace_period_s  # from _stopping_since: a request's may be shorter

    def install(self) -> None:
        if self.requests is not None:
            self.requests.listen(self._on_request)
        if threading.current_thread() is not threading.main_thread():
            # Signals reach only the main thread, and only it may set their handlers: here a launcher owns it (Ray
            # Train runs the training function in a thread of its worker) and stops the workers itself. A stop
            # then loses the steps since the last checkpoint, as a kill does (docs/ray.md), unless the launcher
            # asks first (StopRequests: a Ray node that drains).
            self.log.info("training runs outside the process's main thread: stop signals are the launcher's; "
                          "no checkpoint at SIGTERM%s", "" if self.requests is None else
                          " (one at the launcher's stop request)")
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        if self.requests is not None:
            self.requests.listen(None)
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
        self._start_grace_period(time.monotonic(), self.grace_period_s)

    def _on_request(self, request: StopRequest) -> None:
        """In the requester's thread: as a signal, but said with its reason, and its grace period bounded."""
        now, grace_s = time.monotonic(), self.grace_period_s
        if request.exit_by is not None:
            grace_s = max(0.0, min(grace_s, request.exit_by - now))
        self.request = request
        self.log.warning("%s: stopping at the next step to write a checkpoint, exiting within %.0fs", request.reason,
                         grace_s)
        self._start_grace_period(now, grace_s)

    def _start_grace_period(self, now: float, grace_s: float) -> None:
        if self._deadline_timer is not None:
            return  # a signal and a request both: the first one's grace period holds
        self._stopping_since, self._grace_s = now, grace_s
        self._deadline_timer = threading.Timer(grace_s, self._grace_period_over)
        self._deadline_timer.daemon = True
        self._deadline_timer.start()

    def _grace_period_over(self) -> None:
        self.log.error("grace period of %.0fs over before the checkpoint finished; exiting with %d, the previous "
                       "checkpoint stays valid", self._grace_s, EXIT_PREEMPTED)
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
        some rank's signal (or request)."""
        return self._stopping(self.vote(self.asked_here))

    def should_stop_now(self) -> bool:
        """A collective: where training ends (every rank, same point), the last vote's outcome."""
        return self._stopping(self.vote.settle())

    def _stopping(self, stop: bool) -> bool:
        if stop and self._stopping_since is None:  # another rank's signal: the launcher's kill comes to all alike
            self._stopping_since = time.monotonic()
        return stop

    @property
    def asked_here(self) -> bool:
        """Whether this rank was asked to stop (a signal, a request), not only told so by another rank's vote."""
        return self.signal_received is not None or self.request is not None

    def exit_deadline(self) -> float | None:
        """When a stopping process must be done with everything (time.monotonic()): the grace period from the
        signal, less the forced exit's own cleanup time. None while no stop was asked for."""
        if self._stopping_since is None:
            return None
        return self._stopping_since + self._grace_s - FORCED_EXIT_CLEANUP_S

    def describe(self) -> str:
        if self.signal_received is not None:
            return f"received {signal.Signals(self.signal_received).name}"
        if self.request is not None:
            return self.request.reason
        return "another rank received a stop signal"


def ignore_stop_signals_in_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: the launcher signals the whole process group, and a worker that dies
    first takes the batch the preemption checkpoint is waiting for with it. The main process ends the
    workers itself once the checkpoint is written (and they exit on their own if it dies)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
