"""One job per checkpoint folder: a lease that rank 0 takes at start, renews while training, releases at exit.

Two jobs writing one folder destroy each other (each prunes the other's checkpoints and cleans away
its unfinished saves, and ``--resume latest`` takes the other's state), so a second job is refused.
"The same job" is what a launcher restarts, named by ``DistIdentity.job``: torchrun's run id at its
agent's address, a Slurm job id (kept across requeues), a PyTorchJob's or Compose project's master
address, or ``DDP_JOB_ID``. A restart of the same job takes the lease at once where its holder is surely gone:
released or kept for it, or its process has ended on this very host (the same kernel and process namespace, so
the holder's pid means the same process here). Otherwise the holder may be alive: two jobs can share an identity
(two Compose stacks on two hosts, two jobs given one --job-id), so the lease is watched for two renewal periods
first, taken if nobody renewed it, and refused naming both hosts if somebody did.

The lease is a series of files ``.lease/holder-<generation>.json``; the newest generation is the holder.
Taking it means creating the next generation's file, which exactly one of any number of racing jobs
can do (an exclusive create: ``link()`` on local disks and NFS, a conditional write on S3). The holder
rewrites its file every quarter of ``expires_after_s``; a lease not renewed for that long was left by
a job that could not release it (SIGKILL, a lost node) and is free. The holder's timestamps are its
clock's, which may disagree with the taker's by any amount: they only tell a taker to look closer. A
lease whose timestamps say it expired is taken only once the taker has watched it, on its own monotonic
clock, for half the expiry (two renewal periods) without seeing it renewed. So a taker whose clock runs
ahead can never take a lease that its holder renews; clock skew can at most shorten the time a stalled
holder keeps its lease from the expiry to half of it (a taker whose clock runs behind waits longer). A
job that finds its lease taken over (it was stalled longer than that) stops before its next save.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from trainer.checkpoint.attempts import Attempt, failures_before, refusal
from trainer.checkpoint.lease_record import HOLDER_FILE, LEASE_FOLDER, Holder, holder_file, process_place
from trainer.checkpoint.storage import CheckpointStorage, NotAFile
from trainer.errors import CheckpointError, StorageUnavailable, described
from trainer.redact import redact

RENEWER_JOIN_S = 5.0
TAKE_ATTEMPTS = 5


# An unreadable lease (the storage did not answer) is read again after these pauses before a save gives up.
READ_RETRIES_S = (1.0, 2.0, 4.0)


class LeaseUnreadable(StorageUnavailable):
    """The lease could not be read (the storage did not answer): nothing commits on it, and nothing is pruned. A
    retry may read it: the save fails, as on any storage error, but the folder is not taken for lost."""


class CheckpointLease:
    def __init__(self, storage: CheckpointStorage, job: str, host: str, expires_after_s: float,
                 log: logging.Logger, clock: Callable[[], float] = time.time, job_named: bool = True,
                 monotonic: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 max_failed_attempts: int = 0, restart_count: int = 0) -> None:
        self.storage = storage
        self.job = job
        self.job_named = job_named  # see DistIdentity.job_named: an unnamed job's restart is another job
        self.host = host
        self.expires_after_s = expires_after_s
        self.log = log
        self.clock = clock  # this host's wall clock, written into the lease file for people and other hosts
        self.monotonic = monotonic  # this host's own measure of time passing, for the watch before a take-over
        self.sleep = sleep
        self.generation: int | None = None
        self.lost_to: Holder | None = None
        self.took = ""  # why this job took the lease (written into its record for a job it was taken from)
        self._renewed_at = 0.0  # monotonic() of the last write of this holder's record that succeeded
        self.boot, self.pid_namespace = process_place()
        # --max-attempts-without-progress (0: no limit); this attempt's progress, for its record; the one before
        # (the same job's, as its record says: trainer.checkpoint.attempts).
        self.max_failed_attempts = max_failed_attempts
        self.attempt = Attempt(restart_count=restart_count)
        self.previous: Attempt | None = None
        # The record _end writes, once it ends the lease (renewals stop then; one still under way writes it again).
        self._final: Holder | None = None
        self._wake = threading.Event()  # the renewer writes the record now rather than at its next period
        self._renewer: threading.Thread | None = None

    # -- taking --------------------------------------------------------------------------------------------
    def take(self, take_over: bool = False) -> None:
        """Become the holder, or raise CheckpointError naming the job that holds the folder."""
        renewed_while_watched = False
        for _ in range(TAKE_ATTEMPTS):
            why: str | None = None
            generations = self._generations()
            newest = generations[-1] if generations else 0
            current = self._read(newest) if newest else None
            if newest and current is None and not take_over:
                # Being written by a job taking it this instant (stores whose exclusive create shows the
                # file before its content), or damaged: held either way, until taken over explicitly.
                raise CheckpointError(f"checkpoint folder {self.storage.describe()} is in use by another job (its "
                                      f"lease file {LEASE_FOLDER}/{holder_file(newest)} is being written or is "
                                      f"damaged); if no other job uses the folder, pass --take-over-checkpoint-dir")
            if current is not None:
                why = self._why_free(current, take_over)
                if why is None:
                    raise CheckpointError(self._held_message(current))
                if self._may_be_alive(current, take_over):
                    if renewed_while_watched:  # alive, though its timestamps say otherwise, or one identity twice
                        raise CheckpointError(self._held_message(current, renewed_while_watched=True))
                    if not self._unchanged_while_watched(newest):
                        renewed_while_watched = True  # renewed, released or taken meanwhile: look again
                        continue
                    if current.job == self.job and not current.kept:
                        why = (f"an earlier attempt of this job ({self.job}) on {current.host}, whose lease was not "
                               f"renewed while watched for {self.expires_after_s / 2:.0f}s")
            if current is None and newest:  # taken over while its file was being written (or damaged)
                why = "a lease file being written or damaged (--take-over-checkpoint-dir)"
            self.took = why or ""
            self.previous = current.attempt if current is not None and current.job == self.job else None
            # Until this attempt knows where it resumes (started_at), its record carries the count on: one that
            # ends before that (a resume that fails, a kill while loading) is counted too.
            self.attempt.failed_in_a_row = failures_before(self.previous, -1, self.attempt.restart_count)
            if self.storage.create_exclusive(LEASE_FOLDER, holder_file(newest + 1), self._record().to_bytes()):
                self.generation = newest + 1
                self._renewed_at = self.monotonic()
                if current is not None and current.job == self.job and current.kept:
                    # Kept for this attempt by the one before (CheckpointManager.release_lease): the usual way.
                    self.log.info("took the lease of checkpoint folder %s from %s", self.storage.describe(), why)
                elif current is not None and why != "released":
                    self.log.warning("took over the lease of checkpoint folder %s from %s", self.storage.describe(),
                                     why)
                for older in generations:
                    with contextlib.suppress(OSError):
                        self.storage.remove_file(LEASE_FOLDER, holder_file(older))
                return
            # Another job created that generation first: look again at who holds the folder now.
        raise CheckpointError(f"checkpoint folder {self.storage.describe()}: other jobs keep taking its lease at the "
                              f"same moment; start one job per --checkpoint-dir")

    def _why_free(self, current: Holder, take_over: bool) -> str | None:
        """Why this job may take the lease from ``current`` (for the log), or None if it may not."""
        if current.released:
            return "released"
        age = self.clock() - current.renewed_unix
        if take_over and not current.kept:  # said first: the job it is taken from learns it was not its fault
            return f"job {current.job} on {current.host} (--take-over-checkpoint-dir; renewed {age:.0f}s ago)"
        if current.job == self.job and self._ended_here(current):
            if current.pid == os.getpid():
                return f"an earlier attempt of this job ({self.job}) in this very process"
            return f"an earlier attempt of this job ({self.job}), whose process {current.pid} on this host has ended"
        if current.job == self.job:
            return f"an earlier attempt of this job ({self.job})"
        if age > current.expires_after_s:
            return (f"job {current.job} on {current.host}, whose lease expired (not renewed for {age:.0f}s by its "
                    f"clock, nor for {current.expires_after_s / 2:.0f}s watched from this host)")
        if take_over:
            return f"job {current.job} on {current.host} (--take-over-checkpoint-dir)"
        return None

    def started_at(self, step: int) -> None:
        """This attempt resumes from ``step`` (0: fresh): counted against the attempts before it, and refused
        (CheckpointError) past --max-attempts-without-progress (trainer.checkpoint.attempts). An attempt started
        with no limit begins the count again."""
        self.attempt.start_step = step
        failed = failures_before(self.previous, step, self.attempt.restart_count)
        if self.max_failed_attempts and failed >= self.max_failed_attempts:
            assert self.previous is not None
            self.attempt.failed_in_a_row = failed  # its own record carries the count on: its exit 2 ends nothing
            raise CheckpointError(refusal(self.storage.describe(), self.job, self.previous, failed,
                                          self.max_failed_attempts))
        self.attempt.failed_in_a_row = failed if self.max_failed_attempts else 0
        self.record_soon()

    def committed(self, step: int) -> None:
        self.attempt.committed_step = max(self.attempt.committed_step, step)
        self.record_soon()

    def _may_be_alive(self, current: Holder, take_over: bool) -> bool:
        """Whether the holder may still be renewing the lease this job may take by the rules (``_why_free``), so
        that it is watched first: one that looks expired by its timestamps (clocks disagree), or this job's own
        earlier attempt unless it is surely gone (another live job may have the same identity). A released or kept
        lease has no holder left to renew it, so its record is the whole story; --take-over-checkpoint-dir takes
        it regardless."""
        if current.released or current.kept or take_over:
            return False
        if current.job == self.job:
            return not self._ended_here(current)
        return self.clock() - current.renewed_unix > current.expires_after_s

    def _ended_here(self, current: Holder) -> bool:
        """Whether the holder's process is known to have ended: it ran on this host (the same kernel boot and pid
        namespace, where a pid names the same process) and no process has its pid now, or it is this process
        (an earlier attempt in it, which a run in progress cannot be)."""
        if not current.boot or (current.boot, current.pid_namespace) != (self.boot, self.pid_namespace):
            return False
        if current.pid == os.getpid():
            return True
        try:
            os.kill(current.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # another user's process: alive
            return False
        return False

    def _unchanged_while_watched(self, generation: int) -> bool:
        """Whether the lease's newest file stays as it is for half the expiry, on this host's monotonic clock:
        a holder that is alive renews it every quarter (or a newer holder appears)."""
        def snapshot() -> tuple[list[int], bytes | None]:
            try:
                return self._generations(), self.storage.read(LEASE_FOLDER, holder_file(generation))
            except (FileNotFoundError, NotAFile):
                return self._generations(), None

        before = snapshot()
        self.log.info("the lease of checkpoint folder %s looks expired by its holder's clock; watching it for %.0fs "
                      "before taking it over", self.storage.describe(), self.expires_after_s / 2)
        deadline = self.monotonic() + self.expires_after_s / 2
        while (left := deadline - self.monotonic()) > 0:
            self.sleep(min(1.0, left))
            if snapshot() != before:
                return False
        return True

    def _held_message(self, current: Holder, renewed_while_watched: bool = False) -> str:
        if renewed_while_watched and current.job == self.job:
            return (f"checkpoint folder {self.storage.describe()} is held by a live job with this job's identity "
                    f"({self.job}): rank 0 pid {current.pid} on {current.host} renewed its lease while this job (on "
                    f"{self.host}) watched it, so it is another job, not an earlier attempt of this one. Give each "
                    f"job its own identity with --job-id (or DDP_JOB_ID), or this one another --checkpoint-dir")
        age = max(0.0, self.clock() - current.renewed_unix)
        left = max(0.0, current.expires_after_s - age)
        renewed = (f"lease renewed while this job watched it, though its timestamps are {age:.0f}s old: the two "
                   f"hosts' clocks disagree" if renewed_while_watched else f"lease renewed {age:.0f}s ago")
        expires = "" if renewed_while_watched else f"its lease expires in {left:.0f}s, or "
        unnamed = ("" if self.job_named else
                   "; if it is an earlier attempt of this very job, name the job with --job-id (or DDP_JOB_ID), the "
                   "same for every attempt: no launcher names this one, so its restarts cannot be told from "
                   "another job")
        if current.kept:
            return (f"checkpoint folder {self.storage.describe()} is kept by job {current.job} (on {current.host}) "
                    f"for its next attempt: it stopped {age:.0f}s ago under a launcher that restarts its workers "
                    f"(torchrun --max-restarts), as it does when an elastic job's membership changes. If that job "
                    f"is over, the lease is free in {left:.0f}s, or pass --take-over-checkpoint-dir now; or give "
                    f"this one another --checkpoint-dir")
        return (f"checkpoint folder {self.storage.describe()} is in use by another job ({current.job}, rank 0 pid "
                f"{current.pid} on {current.host}, {renewed}): two jobs in one folder delete each "
                f"other's checkpoints. Wait for that job to finish, or give this one another --checkpoint-dir; if "
                f"that job was killed, {expires}pass --take-over-checkpoint-dir{unnamed}")

    # -- holding -------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise CheckpointError if another job has taken the lease (this one stalled past the expiry)."""
        if self.generation is None:
            return
        if self.lost_to is None:
            newer = [generation for generation in self._generations() if generation > self.generation]
            if newer:
                self.lost_to = self._read(newer[-1]) or Holder("(unreadable)", "?", 0, 0.0, 0.0)
        if self.lost_to is not None:
            raise CheckpointError(self._lost_message(self.lost_to))

    def _lost_message(self, taker: Holder) -> str:
        """Who took the lease and why, as the taker wrote it; "stalled" only where this job did not renew it."""
        quiet = self.monotonic() - self._renewed_at
        by = f"job {taker.job} on {taker.host} (rank 0 pid {taker.pid})"
        if "--take-over-checkpoint-dir" in taker.took:
            how = f"was taken over by {by} with --take-over-checkpoint-dir"
        elif quiet >= self.expires_after_s / 2:
            how = (f"was taken over by {by} while this job did not renew its lease for {quiet:.0f}s (stalled, or its "
                   f"storage did not answer)")
        else:
            how = (f"was taken by {by}, which took it from {taker.took or 'this job'}, although this job renewed "
                   f"its lease {quiet:.0f}s ago")
        return (f"checkpoint folder {self.storage.describe()} {how}; this job stops without writing there. Restart "
                f"it with another --checkpoint-dir, or once the other job is done")

    def confirm(self) -> None:
        """``check``, read again after READ_RETRIES_S where the storage does not answer: a hiccup is not a lost
        lease. CheckpointError if another job took the folder; LeaseUnreadable once every read failed."""
        pauses = READ_RETRIES_S
        for pause in (*pauses, None):
            try:
                self.check()
                return
            except CheckpointError:
                raise
            except Exception as error:  # noqa: BLE001 - any backend's error: not confirmed, nothing commits on it
                if pause is None:
                    raise LeaseUnreadable(
                        f"could not read the lease of checkpoint folder {self.storage.describe()} "
                        f"({redact(described(error), self.storage.location)}, {len(pauses) + 1} tries), so this "
                        f"save cannot tell that the folder is still this job's") from None
                self.sleep(pause)

    def renew(self) -> None:
        self.check()
        generation = self.generation
        if generation is None or self._final is not None:
            return  # ended: the last record is _end's
        self.storage.replace_file(LEASE_FOLDER, holder_file(generation), self._record().to_bytes())
        self._renewed_at = self.monotonic()

    def start_renewing(self) -> None:
        """Renew from a background thread every quarter of the expiry, until release()."""
        self._renewer = threading.Thread(target=self._renew_until_stopped, name="checkpoint-lease", daemon=True)
        self._renewer.start()

    def record_soon(self) -> None:
        """Have the renewer write this holder's record now (this attempt's progress changed), from its own thread:
        a storage that hangs holds the renewer, never training."""
        self._wake.set()

    def _renew_until_stopped(self) -> None:
        while True:
            self._wake.wait(self.expires_after_s / 4)
            self._wake.clear()
            if self._final is not None:
                return
            try:
                generation = self.generation
                self.renew()
                final = self._final
                if final is not None and generation is not None:  # _end's last record came while this one was written
                    self.storage.replace_file(LEASE_FOLDER, holder_file(generation), final.to_bytes())
                    return
            except CheckpointError as problem:
                self.log.error("%s", problem)
                return
            # A storage hiccup (an OSError, or an object store client's own error: botocore's, aiohttp's): the next
            # renewal may work, well before expiry. Renewals stop only at release() or when the lease was lost.
            except Exception as error:  # noqa: BLE001
                self.log.warning("could not renew the lease of %s: %s", self.storage.describe(), error)

    def keep(self) -> None:
        """Stop renewing and mark the lease kept: held until it expires (expires_after_s from now), except for this
        job's next attempt, which takes it at once (a launcher that restarts the workers in place)."""
        self._end(self._record(kept=True), "marked kept")

    def release(self) -> None:
        """Mark the lease free, so that the next job starts at once (a run that resumes this one's work)."""
        self._end(self._record(released=True), "released")

    def _end(self, last: Holder, done: str) -> None:
        """Stop renewing, then write this holder's last record (kept or released), unless the lease was lost."""
        self._final = last
        self._wake.set()
        if self._renewer is not None:
            # A renewal stuck in a hung storage call would hold this forever: the last record is tried regardless
            # (it may hang just the same: callers bound it, CheckpointManager.release_lease_within).
            self._renewer.join(timeout=RENEWER_JOIN_S)
        if self.generation is None:
            return
        try:
            self.check()
            self.storage.replace_file(LEASE_FOLDER, holder_file(self.generation), last.to_bytes())
        except Exception as problem:  # noqa: BLE001 - any backend's error: the lease then expires by itself
            self.log.warning("lease of %s not %s (%s); it expires %gs after its last renewal",
                             self.storage.describe(), done, problem, self.expires_after_s)
        self.generation = None

    # -- files ---------------------------------------------------------------------------------------------
    def _record(self, released: bool = False, kept: bool = False) -> Holder:
        return Holder(self.job, self.host, os.getpid(), self.clock(), self.expires_after_s, released, kept, self.boot,
                      self.pid_namespace, self.took, replace(self.attempt))

    def _generations(self) -> list[int]:
        found = (HOLDER_FILE.match(name) for name in self.storage.files(LEASE_FOLDER))
        return sorted(int(match.group(1)) for match in found if match)

    def _read(self, generation: int) -> Holder | None:
        try:
            return Holder.from_bytes(self.storage.read(LEASE_FOLDER, holder_file(generation)))
        except (FileNotFoundError, NotAFile):
            return None  # gone (taken over meanwhile), or a link or a folder: no holder record either way
