"""Saving and finding checkpoints: rank 0 writes, everyone agrees on the outcome, the newest valid one wins.

Never loses a good checkpoint: a new one is committed before any old one is pruned, and a broken
one (no manifest, wrong size or checksum, unreadable) is reported and skipped, never used.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainer.checkpoint import dcp_writer, shards
from trainer.checkpoint.lease import CheckpointLease
from trainer.checkpoint.reading import InvalidCheckpoint, UnknownFormat
from trainer.checkpoint.retention import Monitor, Retention
from trainer.checkpoint.save_failures import SaveFailure, is_transient
from trainer.checkpoint.save_outcomes import SaveOutcomes, SaveRetry
from trainer.checkpoint.schema import TrainingState, library_versions
from trainer.checkpoint.snapshot import HostSnapshots, Snapshot
from trainer.checkpoint.storage import checkpoint_name, open_storage
from trainer.checkpoint.verification import LoadedCheckpoint, verify, verify_path
from trainer.checkpoint.writer import CheckpointWriter, SaveTiming
from trainer.config import CheckpointConfig
from trainer.distributed import Runtime, broadcast_from_main, gather_to_main
from trainer.errors import EXIT_OK, EXIT_PREEMPTED, CheckpointError, StorageUnavailable, described
from trainer.redact import redact

__all__ = ["FAILED", "FINISHED", "STOPPED", "CheckpointManager", "Committed", "InvalidCheckpoint", "Monitor",
           "SaveRetry", "SaveTiming", "UnknownFormat"]

# After a write stalled, the lease's release goes to the same storage: tried for this long, then left to expire.
RELEASE_AFTER_STALL_S = 2.0
# At a normal end: a release that takes longer is left to the lease's expiry (the storage hangs).
RELEASE_S = 10.0
# How a run ended, for the lease (release_lease).
FINISHED, STOPPED, FAILED = "finished", "stopped", "failed"


@dataclass
class Committed:
    """A checkpoint every rank knows to be committed, as CheckpointManager.on_commit is told of it."""

    step: int
    epoch: int  # the epochs completed at that step
    metrics: dict[str, float]  # the evaluation's, for a save at the end of an epoch; else empty
    location: str | None = None  # its folder or URL, on rank 0 (which commits); None on the other ranks
    # When it was committed (its manifest's created_unix), on every rank: under --async-checkpoint, every rank
    # learns of a commit only at the next save or the run's end, well after it.
    created_unix: float | None = None


class CheckpointManager:
    def __init__(self, config: CheckpointConfig, location: str, runtime: Runtime, log: logging.Logger,
                 monitor: Monitor | None = None) -> None:
        self.config = config
        self.runtime = runtime
        self.log = log
        self.monitor = monitor
        self.storage = open_storage(location)
        self.retention = Retention(self.storage, config, monitor, log, self._check_lease)
        self.writer = CheckpointWriter(self.storage, config, runtime, log, self.retention)
        self.outcomes = SaveOutcomes(config, runtime, log)
        self._snapshots: list[Snapshot] = []  # the asynchronous save's copies that before_update waits for
        self._host = HostSnapshots()
        self._side_group: Any = None  # the sharded writers' own gloo group, made at the first sharded save
        # Told, on every rank at the same point, of each checkpoint every rank knows to be committed (a launcher's
        # hook: Ray Train's report, trainer.on_ray): see Committed.
        self.on_commit: Callable[[Committed], None] | None = None
        self._unconfirmed: Committed | None = None  # the save launched last, until every rank knows its outcome
        self.committed_step: int | None = None  # the step of the newest save every rank knows committed (this run's)

    @property
    def lease(self) -> CheckpointLease | None:
        """The folder's lease, on rank 0 once taken (``prepare``) until released."""
        return self.writer.lease

    @lease.setter
    def lease(self, lease: CheckpointLease | None) -> None:
        self.writer.lease = lease

    @property
    def last_committed(self) -> str | None:
        """The name of the newest checkpoint this run committed (on rank 0)."""
        return self.writer.last_committed

    @property
    def last_timing(self) -> SaveTiming:
        return self.writer.last_timing

    def _check_lease(self) -> None:
        self.writer.check_lease()

    # -- start ---------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """On rank 0: check the location, take its lease (trainer.checkpoint.lease), then clear crashed saves'
        leftovers, which the lease makes this job's own or stale; every rank learns the outcome."""
        error: SaveFailure | None = None
        if self.runtime.is_main:
            try:
                self.storage.check_writable()
                identity = self.runtime.identity
                lease = CheckpointLease(self.storage, identity.job, identity.hostname, self.config.lease_expiry_s,
                                        self.log, job_named=identity.job_named,
                                        max_failed_attempts=self.config.max_attempts_without_progress,
                                        restart_count=identity.restart_count)
                try:
                    lease.take(take_over=self.config.take_over_checkpoint_dir)
                except OSError as problem:
                    said = (f"cannot take the lease of checkpoint folder {self.storage.describe()} "
                            f"({problem.strerror or problem})")
                    if is_transient(problem):  # the storage failed: the restarted job may find it answering
                        raise StorageUnavailable(said) from None
                    raise CheckpointError(f"{said}; fix its permissions or choose another --checkpoint-dir") from None
                self.lease = lease
                lease.start_renewing()
                self.retention.remove_leftovers()
            except CheckpointError as problem:
                error = SaveFailure.of(problem)
        self._raise_everywhere(error)

    def load(self, resume: str) -> LoadedCheckpoint | None:
        """Rank 0 finds and verifies the checkpoint to resume from and sends it to every rank."""
        outcome: LoadedCheckpoint | SaveFailure | None = None
        if self.runtime.is_main:
            try:
                found = self._find(resume)
                # Never the whole state to every rank: each reads what it holds from the files.
                outcome = None if found is None else found.for_every_rank()
                if self.lease is not None:  # where this attempt starts: refused after too many without progress
                    self.lease.started_at(0 if found is None else found.state.position.step)
            except CheckpointError as problem:  # StorageUnavailable where the storage failed: exit 200, retried
                outcome = SaveFailure.of(problem)
            except UnknownFormat as problem:
                outcome = SaveFailure(str(problem), transient=False)
        self.runtime.wait_for_all("rank 0 to read the checkpoint to resume from")
        outcome = broadcast_from_main(outcome, self.runtime)
        if isinstance(outcome, SaveFailure):
            raise outcome.error()
        return outcome

    def _find(self, resume: str) -> LoadedCheckpoint | None:
        if resume == "none":
            return None
        if resume != "latest":
            return self._load_path(resume)
        try:
            names = self.storage.list_checkpoints()
        except Exception as error:  # noqa: BLE001 - any backend's error: the folder's checkpoints are unknown
            raise (StorageUnavailable if is_transient(error) else CheckpointError)(redact(
                f"cannot list checkpoint folder {self.storage.describe()} ({described(error)}); the run does not "
                f"start afresh over checkpoints it cannot see: start it again once the storage answers, or pass "
                f"--resume none", self.storage.location)) from None
        for name in names:
            try:
                return verify(self.storage, name)
            except InvalidCheckpoint as problem:
                self.log.warning("skipping checkpoint %s: %s", self.storage.describe(name), problem)
        return None

    def _load_path(self, path: str) -> LoadedCheckpoint:
        try:
            return verify_path(path)
        except InvalidCheckpoint as problem:
            raise CheckpointError(
                f"--resume {path}: {problem}; pass another checkpoint folder, --resume latest to take the newest "
                f"valid one, or --resume none to start afresh"
            ) from None
        except UnknownFormat as problem:
            raise CheckpointError(f"--resume {path}: {problem}") from None
        except OSError as error:
            raise CheckpointError(f"--resume {path}: cannot read it ({error.strerror or error})") from None
        except Exception as error:  # noqa: BLE001 - a storage client's own (botocore's): one line, never a traceback
            raise CheckpointError(redact(f"--resume {path}: cannot read it ({' '.join(str(error).split())[:300]})",
                                         path)) from None

    # -- save ----------------------------------------------------------------------------------------------
    def save(self, state: TrainingState, metrics: dict[str, float] | None = None,
             changed_by_step_only: Callable[[str], bool] = lambda path: False,
             final_deadline: float | None = None) -> None:
        """Called by every rank at the same step; rank 0 writes, the others learn whether it worked.

        The state's per-rank parts (the random generators) are gathered from every rank. Synchronous saves
        return after the commit; asynchronous ones after the snapshot, and the next save or ``finish`` collects
        the outcome. ``metrics``: the evaluation's, recorded in the manifest (--keep-best reads them there).

        ``changed_by_step_only``: for a path ``/<part>/...`` of the state, whether nothing but the next optimizer
        step changes it (the parameters, the optimizer's state; trainer.checkpoint.parts). An asynchronous save
        copies those in its background thread while training computes the next gradients; ``before_update``
        waits for that copy.

        A save that fails on a storage error a retry may fix (trainer.checkpoint.save_failures) is a warning on
        every rank and training goes on, up to --max-failed-saves in a row (then StorageUnavailable, exit 200).
        ``final_deadline`` (time.monotonic(), rank 0's counts): the run's last save, at its end or on preemption,
        which is not given up: until then, a failure raises SaveRetry (the caller saves again after its delay).
        """
        self._settle(self.writer.wait())
        self.outcomes.final_deadline = final_deadline
        self._unconfirmed = Committed(state.position.step, state.position.epoch, dict(metrics or {}))
        if shards.has_sharded(state.parts):
            self._save_sharded(state, metrics)
            return
        gathered = {name: gather_to_main(state.parts[name], self.runtime) for name in state.per_rank}
        failure = None
        if self.runtime.is_main:
            state.parts.update({name: values or [] for name, values in gathered.items()})
            state.versions = library_versions()
            raw, described = state.to_dict(), state.manifest(metrics)
            name = checkpoint_name(state.position.step)
            raw, copies = self._take(raw, "", changed_by_step_only)
            # A synchronous save is written by the same thread, and waited for at once: either way a file
            # system that never answers cannot hold the job past --checkpoint-timeout-s.
            self.writer.launch(name, self.writer.write_whole, (name, raw, described, copies))
            if not self.config.async_checkpoint:
                failure = self.writer.wait()
        if not self.config.async_checkpoint:
            self._settle(failure)

    def _save_sharded(self, state: TrainingState, metrics: dict[str, float] | None) -> None:
        """Every rank writes its share of the tensors into the new folder through DCP (trainer.checkpoint.dcp_writer),
        in parallel; rank 0 then writes the state file (the parts, each tensor replaced by a marker), the items'
        checksums and the manifest (every file's size and checksum), and commits the folder. An asynchronous save
        returns once this rank's tensors are copied to host memory; a synchronous one writes them where they are
        (training waits for it), with no copy."""
        split = dcp_writer.split(state.parts, state.per_rank)
        gathered = {name: gather_to_main(state.parts[name], self.runtime) for name in state.per_rank}
        name = checkpoint_name(state.position.step)
        opened: tuple[str | None, SaveFailure | None] = (None, None)
        if self.runtime.is_main:
            # The lease's reads may be retried and the store may be slow: the other ranks wait for this while rank 0
            # is alive, past --collective-timeout-s (trainer.liveness), as for the save's outcome.
            with self.runtime.busy(f"opening checkpoint {name}"):
                try:
                    self._check_lease()
                    opened = (self.storage.begin(name, self.writer.generation()), None)
                except CheckpointError as problem:
                    opened = (None, SaveFailure.of(problem))
        self.runtime.wait_for_all("rank 0 to open the checkpoint's folder")
        temporary, failure = broadcast_from_main(opened, self.runtime)
        if temporary is None:
            self._settle(failure)  # raises, or the failure is tolerated: training goes on without this save
            return
        group = self.side_group()
        # Training goes on meanwhile under --async-checkpoint: what is written are copies in host memory of every
        # tensor of this step, sharded or not (AdamW's step counts, BatchNorm's statistics).
        tensors, copies = self._take(split.tensors, "/tensors", lambda path: False)
        raw: dict[str, Any] = {}
        described: dict[str, Any] = {}
        if self.runtime.is_main:
            state.parts = {**split.plain, **{part: values or [] for part, values in gathered.items()}}
            state.versions = library_versions()
            raw, described = state.to_dict(), state.manifest(metrics)
        self.writer.launch(name, self.writer.write_sharded,
                            (name, temporary, tensors, split.layout, raw, described, copies, group))
        if not self.config.async_checkpoint:
            self._settle(self.writer.wait())

    def side_group(self) -> Any:
        """The checkpoint's own gloo group, made once on every rank (a collective): DCP's planning and the ranks'
        reports run on it, from the writer thread, apart from training's collectives. Its timeout is the save's
        (gloo's default, 30 minutes, would end a longer allowed save early). None without a process group."""
        if self._side_group is None and dist.is_initialized():
            self._side_group = dist.new_group(backend="gloo",
                                              timeout=timedelta(seconds=self.config.checkpoint_timeout_s))
        return self._side_group

    def _take(self, state: Any, path: str, deferrable: Callable[[str], bool]) -> tuple[Any, list[Snapshot]]:
        """Under --async-checkpoint, the state as host copies (trainer.checkpoint.snapshot) and the copies to
        complete; else the state itself, written before training goes on."""
        if not self.config.async_checkpoint:
            return state, []
        snapshot = self._host.take(state, path, deferrable)
        self._snapshots.append(snapshot)
        return snapshot.state, [snapshot]

    def before_update(self) -> None:
        """Before the optimizer changes the parameters: an asynchronous save's copy of them is complete."""
        snapshots, self._snapshots = self._snapshots, []
        for snapshot in snapshots:
            snapshot.before_update()

    def finish(self) -> None:
        """Wait for a background write and settle its outcome on every rank (``_settle``)."""
        self._settle(self.writer.wait())

    def _confirm(self, committed: Committed) -> None:
        """Every rank has just learnt that this save committed: tell on_commit, with its location on rank 0."""
        if self.on_commit is None:
            return
        if self.runtime.is_main and self.last_committed is not None:
            committed.location = self.storage.describe(self.last_committed)
        self.on_commit(committed)

    @property
    def stalled(self) -> bool:
        """Whether a write outlasted --checkpoint-timeout-s: the storage may not answer any more."""
        return self.writer.stalled

    def release_lease(self, ending: str = FINISHED, exit_code: int = -1, failure: str = "") -> None:
        """End this job's hold on the folder now, without waiting for a save in progress (an exit without one).
        Released, so that the next job starts at once; but where the launcher starts this job's workers again
        itself (``restarts_left``), a run that stops before its end keeps it for the next attempt, so that no other
        job takes the folder in between: stopped by a signal this rank received (a membership change of an elastic
        job looks the same as the launcher's own end), or failed (stopped by another rank's signal included: its
        launcher counts that exit as a failure) with restarts left. Kept, it is marked so and no longer renewed:
        another job may take it once it expires (--lease-expiry-s from now), and is told why it waits. ``exit_code``
        and ``failure``: how the process ends, for the next attempt's count of attempts without progress."""
        if self.lease is None:
            return
        ended = {FINISHED: EXIT_OK, STOPPED: EXIT_PREEMPTED}
        self.lease.attempt.exit_code = ended.get(ending, exit_code)
        self.lease.attempt.failure = failure
        left = self.runtime.identity.restarts_left
        if left is not None and (ending == STOPPED or (ending == FAILED and left > 0)):
            self.lease.keep()
            self.log.info("keeping the lease of checkpoint folder %s for this job's next attempt, should %s start "
                          "one (%s); any other job may take it once it expires, in %gs",
                          self.storage.describe(), self.runtime.identity.launcher,
                          "stopped by a signal" if ending == STOPPED else f"{left} restart(s) left",
                          self.config.lease_expiry_s)
        else:
            self.lease.release()
        self.lease = None

    def close(self, ending: str = FINISHED, exit_code: int = -1, failure: str = "") -> None:
        """End the folder's lease (on rank 0; local, no collective; ``release_lease``): the next job may start at
        once. ``ending``: how the run ended (FINISHED, STOPPED by a signal, FAILED)."""
        if not self.writer.stalled:
            # A save still being written belongs to this job's time in the folder, up to its deadline; past it,
            # the write is given up (CheckpointWriter._why_no_longer) and the lease released as after any stall.
            unsettled = self.writer.wait()
            if unsettled is not None and unsettled.stalled:
                self.log.warning("%s", unsettled.message)
        if self.writer.stalled:  # the storage does not answer: neither the write nor a release would end
            self.release_lease_within(RELEASE_AFTER_STALL_S, ending, exit_code, failure)
            return
        # A storage that hangs now must not keep a finished job alive.
        self.release_lease_within(RELEASE_S, ending, exit_code, failure)

    def release_lease_within(self, seconds: float, ending: str = FINISHED, exit_code: int = -1,
                             failure: str = "") -> None:
        """End the lease from a thread given ``seconds``: the storage may be what hangs (a forced exit)."""
        releaser = threading.Thread(target=self.release_lease, args=(ending, exit_code, failure), name="lease-release",
                                    daemon=True)
        releaser.start()
        releaser.join(seconds)

    def _settle(self, failure: SaveFailure | None) -> None:
        """Every rank learns how the save launched last ended (trainer.checkpoint.save_outcomes): on_commit is told
        of one that committed; one that failed raises, or is tolerated and dropped."""
        # Cleared first, on every rank alike, whatever settle raises: a save is settled once.
        unconfirmed, self._unconfirmed = self._unconfirmed, None
        if unconfirmed is None:
            return  # no save outstanding (the same on every rank: set and cleared on all at once)
        last = self._last_committed_said() if self.runtime.is_main else ""
        if self.outcomes.settle(failure, unconfirmed.step, last):
            self.committed_step = unconfirmed.step
            if self.lease is not None:
                self.lease.committed(unconfirmed.step)
            if self.on_commit is not None:  # the same on every rank: a collective only where someone is told
                unconfirmed.created_unix = broadcast_from_main(self.writer.last_timing.created_unix, self.runtime)
            self._confirm(unconfirmed)

    def _last_committed_said(self) -> str:
        """The checkpoint a restart would resume from, in words (on rank 0)."""
        if self.last_committed is not None:
            return f"The last committed checkpoint is {self.storage.describe(self.last_committed)}"
        return f"This run committed no checkpoint yet; the earlier ones in {self.storage.describe()} are intact"

    def _raise_everywhere(self, failure: SaveFailure | None) -> None:
        """Rank 0's error at the start (taking the lease), raised on every rank, so no rank waits for one that has
        quit: StorageUnavailable (exit 200) where a retry may fix it."""
        self.runtime.wait_for_all("rank 0's checkpoint work")
        failure = broadcast_from_main(failure, self.runtime)
        if failure is not None:
            if self.runtime.is_main:
                raise failure.error()
            raise failure.error(f"rank 0 could not use the checkpoint folder: {failure.message}")


