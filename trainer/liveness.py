"""Telling a busy peer from a stalled one: each rank's heartbeat in the job's store, and waits for long work.

A collective waits at most ``--collective-timeout-s`` for every rank. That bound is wrong for known long
work on some ranks (rank 0 writing a checkpoint to slow storage, one rank per node downloading data):
the others would give up on a peer that is working. So such work ends in ``wait_for_all``, which waits
in the store as long as the working ranks' heartbeats go on, and fails only when one of them has been
silent for ``--collective-timeout-s``. A heartbeat is written by a thread of its own: it stops when the
whole process stops (SIGSTOP, a frozen VM, swapping to death), not while the main thread is busy.

When a collective itself times out, ``diagnose`` reads the heartbeats to say which rank was late and
whether it is stalled (silent) or alive but elsewhere (another step, other work).

A rank whose main thread is stuck where no collective of ours times out (a device synchronisation behind an
NCCL kernel that never ends, a deadlock in a user's code) is found by ``watch_progress``: during training,
a micro-batch that does not end within the stuck-after time ends the process with the diagnosis, before
NCCL's own watchdog would abort it without one (trainer.distributed.nccl_timeout_s gives NCCL's timeout a
margin beyond this).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from trainer.errors import PeerLost
from trainer.launchers import DistIdentity
from trainer.peer_watch import PeerWatch, gone_key

__all__ = ["Liveness"]

HEARTBEAT_EVERY_S = 1.0
HEARTBEAT_KEY = "ddp-deploy/heartbeat/"
DONE_KEY = "ddp-deploy/done/"
# A diagnosis after a timeout watches the heartbeats this long: several beats, so a silent rank is stalled.
DIAGNOSIS_WATCH_S = 3.0
STORE_READ_TIMEOUT_S = 5.0  # the least time a store read is given (more where --collective-timeout-s is more)
# The progress watchdog gives a stuck micro-batch --collective-timeout-s and this long: a collective that
# times out on its own (gloo) is diagnosed first, in the main thread.
PROGRESS_GRACE_S = 10.0
T = TypeVar("T")


class StoreSilent(PeerLost):
    """The job's store (on rank 0) did not answer a read in time."""


@dataclass
class Beat:
    """One rank's heartbeat as read from the store."""

    count: int
    step: int
    doing: str
    progress: int = 0  # points of the training loop passed (Liveness.made_progress)

    @classmethod
    def parse(cls, raw: bytes) -> Beat:
        count, step, progress, doing = raw.decode().split(" ", 3)
        return cls(int(count), int(step), doing, int(progress))


class Liveness:
    def __init__(self, store: dist.Store, identity: DistIdentity, silent_after_s: float,
                 beat_every_s: float = HEARTBEAT_EVERY_S, peer_watch: PeerWatch | None = None) -> None:
        self.identity = identity
        self.peer_watch = peer_watch  # dead peers told from frozen ones at once (trainer.peer_watch)
        self._published: set[int] = set()
        self.silent_after_s = silent_after_s
        self.beat_every_s = beat_every_s
        self.step = 0
        self.doing = "starting"
        self._store = store.clone()  # the main thread's own connection (the heartbeat thread has another)
        # As long as _answer waits for a read: a client timeout shorter than that made a store slowed by load
        # (8 ranks on 2 cores) raise "timed out" after 5 s, which was taken for a collective's timeout.
        self._store.set_timeout(timedelta(seconds=self.store_read_deadline_s))
        self._beater_store = store.clone()
        self._stop = threading.Event()
        self._count = 0
        self._rounds = 0
        self.progress = 0  # points of the training loop this rank has passed (made_progress)
        self._beat()  # at once: a peer that looks before the first interval finds one
        self._thread = threading.Thread(target=self._beat_until_stopped, name="heartbeat", daemon=True)
        self._thread.start()
        self._watchdog: threading.Thread | None = None

    @property
    def store_read_deadline_s(self) -> float:
        return max(self.silent_after_s, STORE_READ_TIMEOUT_S)

    def close(self) -> None:
        if self.peer_watch is not None:
            self.peer_watch.close()
        self._stop.set()
        self._thread.join(timeout=STORE_READ_TIMEOUT_S)
        if self._watchdog is not None:
            self._watchdog.join(timeout=STORE_READ_TIMEOUT_S)

    # -- a stuck main thread -------------------------------------------------------------------------------
    def made_progress(self) -> None:
        """The main thread passed a point of the training loop: a micro-batch's loss, its end."""
        self.progress += 1

    def watch_progress(self, stuck_after_s: float, on_stuck: Callable[[str], None],
                       look_every_s: float = 1.0) -> None:
        """From a thread: while training, after this rank's first micro-batch (whose compilation, forward and
        backward, and first data may take long), ``stuck_after_s`` without passing another point of the loop
        calls ``on_stuck`` once with what this rank was doing and what the others are doing (``others``).
        ``on_stuck`` ends the process."""
        def watch() -> None:
            seen, since = self.progress, time.monotonic()
            while not self._stop.wait(look_every_s):
                now = time.monotonic()
                if self.progress != seen or self.doing != "training" or self.progress < 2:
                    seen, since = self.progress, now
                    continue
                if now - since > stuck_after_s:
                    others = self.others() or "rank 0, which hosts the job's store, does not answer: it is gone"
                    on_stuck(f"rank {self.identity.rank}'s training made no progress for {now - since:.0f}s at step "
                             f"{self.step} (stuck waiting for a device synchronisation or a collective that never "
                             f"completes, or in the task's own code); the others: {others}")
                    return

        self._watchdog = threading.Thread(target=watch, name="progress-watchdog", daemon=True)
        self._watchdog.start()

    # -- this rank -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def busy(self, doing: str) -> Iterator[None]:
        """Name what this rank is doing while it does it (shown to peers that wait for it)."""
        before, self.doing = self.doing, doing
        try:
            yield
        finally:
            self.doing = before

    def _beat(self) -> None:
        self._count += 1
        # One word-separated value: the step and the doing are read at once with the count.
        self._beater_store.set(f"{HEARTBEAT_KEY}{self.identity.rank}",
                               f"{self._count} {self.step} {self.progress} {self.doing}")

    def _beat_until_stopped(self) -> None:
        while not self._stop.wait(self.beat_every_s):
            try:
                self._beat()
            except (RuntimeError, OSError):
                return  # the store is gone (rank 0 ended or died): the main thread will find out in its own way

    # -- the others ----------------------------------------------------------------------------------------
    def _answer(self, call: Callable[[], T]) -> T:
        """A read of the job's store, bounded: a store whose host is stopped (SIGSTOP) keeps the connection
        open and never answers, and TCPStore's check() waits for ever. Read in a daemon thread, given up on
        after ``silent_after_s`` (the thread, stuck, ends with the process)."""
        outcome: list[Any] = []

        def read() -> None:
            try:
                outcome.append((True, call()))
            except Exception as error:  # noqa: BLE001 - handed to the caller's thread as it is
                outcome.append((False, error))

        reader = threading.Thread(target=read, name="store-read", daemon=True)
        reader.start()
        # As long as a silent peer is given, and never less than a few seconds: 8 ranks on 2 cores can keep
        # rank 0's store from answering for seconds (a false "stopped" there failed whole jobs).
        deadline_s = self.store_read_deadline_s
        reader.join(deadline_s)
        if not outcome:
            raise StoreSilent(f"rank 0, which hosts the job's store, did not answer for {deadline_s:g}s: it is "
                              f"stopped, frozen or gone")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def wait_for_all(self, what: str) -> None:
        """Every rank calls this after its part of ``what`` (long on some ranks); returns when all have.

        Waits as long as the ranks not done yet keep beating; raises PeerLost naming a rank silent for
        ``silent_after_s``. Every rank calls it the same number of times in the same order.
        """
        with self.busy(f"waiting for {what}"):  # not stuck: the progress watchdog leaves such waits alone
            self._wait_for_all(what)

    def _wait_for_all(self, what: str) -> None:
        self._rounds += 1
        prefix = f"{DONE_KEY}{self._rounds}/"
        pending = [rank for rank in range(self.identity.world_size) if rank != self.identity.rank]
        try:
            self._answer(functools.partial(self._store.set, f"{prefix}{self.identity.rank}", "1"))
            watch = _Watch(self, pending)
            delay = 0.005
            while pending:
                pending = self._answer(functools.partial(self._not_done, prefix, pending))
                if not pending:
                    break
                gone = self._answer(functools.partial(self._gone, prefix, pending))
                if gone:
                    rank, said = gone
                    raise PeerLost(f"rank {rank} is gone while the others waited for {what}: {said} (its process "
                                   f"ended: crashed, killed, out of memory; or its machine was lost); its own log, "
                                   f"if any, says why")
                silent = watch.silent(pending, self.silent_after_s)
                if silent:
                    rank, beat = silent[0]
                    raise PeerLost(f"rank {rank} stopped responding while the others waited for {what}: no "
                                   f"heartbeat for {self.silent_after_s:g}s (--collective-timeout-s), last at step "
                                   f"{beat.step} while {beat.doing}; the process is stopped or frozen (SIGSTOP, "
                                   f"swapping, a hung file system) or its machine is gone")
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
            if self._rounds > 1:
                # Every rank has set its key of this round, so every rank is past the previous one: nobody reads
                # this rank's key of it again. The store keeps at most two rounds' keys, however long the job.
                self._answer(functools.partial(self._store.delete_key, f"{DONE_KEY}{self._rounds - 1}/"
                                                                      f"{self.identity.rank}"))
        except StoreSilent as silent_store:
            raise StoreSilent(f"{silent_store} (while the others waited for {what})") from None

    def _gone(self, prefix: str, ranks: list[int]) -> tuple[int, str] | None:
        """The first of ``ranks`` that a peer watch (trainer.peer_watch) found gone before it was done, and how:
        after publishing what this rank's own watch found, for the ranks that wait elsewhere."""
        found = self.peer_watch.found() if self.peer_watch is not None else {}
        for rank, how in found.items():
            if rank not in self._published:
                self._store.set(gone_key(rank), how)
                self._published.add(rank)
        for rank in ranks:
            # Done after all (it finished and ended between the two reads): not lost.
            if self._store.check([gone_key(rank)]) and self._not_done(prefix, [rank]):
                return rank, self._store.get(gone_key(rank)).decode(errors="replace")
        return None

    def _not_done(self, prefix: str, ranks: list[int]) -> list[int]:
        return [rank for rank in ranks if not self._store.check([f"{prefix}{rank}"])]

    def diagnose(self, timeout_s: float, watch_s: float = DIAGNOSIS_WATCH_S) -> str:
        """After a collective timed out: which ranks were late, and whether they are stalled or elsewhere
        (their heartbeats watched for ``watch_s``, several beats)."""
        where = self.others(watch_s)
        if where is None:
            return (f"a collective timed out after {timeout_s:g}s (--collective-timeout-s), and rank 0, which hosts "
                    f"the job's store, does not answer either: it is stopped, frozen or gone")
        return f"a collective at step {self.step} timed out after {timeout_s:g}s (--collective-timeout-s): {where}"

    def others(self, watch_s: float = DIAGNOSIS_WATCH_S) -> str | None:
        """What the other ranks are doing, their heartbeats watched for ``watch_s``; None if the store (rank 0)
        does not answer."""
        others = [rank for rank in range(self.identity.world_size) if rank != self.identity.rank]
        try:
            watch = _Watch(self, others)
            time.sleep(watch_s)
            silent = dict(watch.silent(others, watch_s - self.beat_every_s / 2))
            beats = watch.read(others)
        except (StoreSilent, RuntimeError, OSError):
            return None
        late = []
        for rank in others:
            beat = silent.get(rank) or beats.get(rank)
            if rank in silent:
                late.append(f"rank {rank} stopped responding (no heartbeat for {watch_s:g}s, last at step "
                            f"{beat.step} while {beat.doing}: stopped or frozen, e.g. SIGSTOP, swapping, a hung "
                            f"file system)")
            elif beat is not None and (beat.step != self.step or beat.doing != self.doing):
                late.append(f"rank {rank} is alive but at step {beat.step}, {beat.doing}")
            elif beat is not None and beat.progress < self.progress:
                late.append(f"rank {rank} is alive at step {beat.step} but behind this rank inside it (stuck in its "
                            f"forward pass or loss, or waiting for its device)")
        return "; ".join(late) or "every rank is alive and at the same step (a network problem between them?)"


class _Watch:
    """When each rank's heartbeat last changed, as seen from here (no clocks compared between machines)."""

    def __init__(self, liveness: Liveness, ranks: list[int]) -> None:
        self.liveness = liveness
        self.seen: dict[int, tuple[Beat | None, float]] = {}
        self.read(ranks)

    def read(self, ranks: list[int]) -> dict[int, Beat]:
        beats = {}
        now = time.monotonic()
        found = self.liveness._answer(functools.partial(self._beats_of, ranks))
        for rank in ranks:
            beat = found[rank]
            previous = self.seen.get(rank)
            if previous is None or previous[0] != beat:
                self.seen[rank] = (beat, now)
            if beat is not None:
                beats[rank] = beat
        return beats

    def _beats_of(self, ranks: list[int]) -> dict[int, Beat | None]:
        store = self.liveness._store
        keys = {rank: f"{HEARTBEAT_KEY}{rank}" for rank in ranks}
        return {rank: Beat.parse(store.get(key)) if store.check([key]) else None for rank, key in keys.items()}

    def silent(self, ranks: list[int], for_s: float) -> list[tuple[int, Beat]]:
        """The ranks whose heartbeat has not changed for ``for_s`` seconds, with their last beat."""
        self.read(ranks)
        now = time.monotonic()
        return [(rank, beat or Beat(0, 0, "starting")) for rank in ranks
                for beat, since in [self.seen[rank]] if now - since > for_s]
