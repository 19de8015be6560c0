"""Saving and finding checkpoints: rank 0 writes, everyone agrees on the outcome, the newest valid one wins.

Never loses a good checkpoint: a new one is committed before any old one is pruned, and a broken
one (no manifest, wrong size or checksum, unreadable) is reported and skipped, never used.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.serialization import config as serialization_config

from trainer.checkpoint import dcp_errors, dcp_items, dcp_writer, shards
from trainer.checkpoint.lease import CheckpointLease
from trainer.checkpoint.reading import MAX_MANIFEST_BYTES, STATE_FILE, InvalidCheckpoint, UnknownFormat
from trainer.checkpoint.save_failures import SaveFailure, is_transient, is_transient_type_name
from trainer.checkpoint.schema import DCP_FORMAT, FORMAT, TrainingState, library_versions
from trainer.checkpoint.snapshot import HostSnapshots, Snapshot
from trainer.checkpoint.storage import MANIFEST, FileWriter, checkpoint_name, open_storage, saved_in_place, step_of
from trainer.checkpoint.verification import LoadedCheckpoint, verify, verify_path
from trainer.config import CheckpointConfig
from trainer.distributed import Runtime, broadcast_from_main, gather_to_main
from trainer.errors import CheckpointError, StorageStalled, StorageUnavailable, described
from trainer.redact import redact

# After a write stalled, the lease's release goes to the same storage: tried for this long, then left to expire.
RELEASE_AFTER_STALL_S = 2.0
# At a normal end: a release that takes longer is left to the lease's expiry (the storage hangs).
RELEASE_S = 10.0
# How a run ended, for the lease (release_lease).
FINISHED, STOPPED, FAILED = "finished", "stopped", "failed"


# An unreadable lease (the storage did not answer) is read again after these pauses before the save gives up.
LEASE_READ_RETRIES_S = (1.0, 2.0, 4.0)
# A final save that failed on a storage error is tried again after these pauses, within its deadline.
FINAL_SAVE_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0)


class LeaseUnreadable(StorageUnavailable):
    """The lease could not be read (the storage did not answer): nothing commits on it, and nothing is pruned. A
    retry may read it: the save fails, as on any storage error, but the folder is not taken for lost."""


class SaveRetry(Exception):
    """A final save failed on a storage error and rank 0 chose to try again, on every rank, in ``delay_s``."""

    def __init__(self, message: str, delay_s: float) -> None:
        super().__init__(message)
        self.delay_s = delay_s


@dataclass(frozen=True)
class Monitor:
    """The manifest metric --keep-best keeps the best checkpoint by."""

    metric: str
    mode: str  # "max" or "min"


@dataclass
class Committed:
    """A checkpoint every rank knows to be committed, as CheckpointManager.on_commit is told of it."""

    step: int
    epoch: int  # the epochs completed at that step
    metrics: dict[str, float]  # the evaluation's, for a save at the end of an epoch; else empty
    location: str | None = None  # its folder or URL, on rank 0 (which commits); None on the other ranks


@dataclass
class SaveTiming:
    write_s: float = 0.0  # serialise + checksum + write + fsync + commit
    bytes: int = 0
    copied_later_bytes: int = 0  # an asynchronous save's tensors copied after save() returned


class CheckpointManager:
    def __init__(self, config: CheckpointConfig, location: str, runtime: Runtime, log: logging.Logger,
                 monitor: Monitor | None = None) -> None:
        self.config = config
        self.runtime = runtime
        self.log = log
        self.monitor = monitor
        self.storage = open_storage(location)
        self.last_timing = SaveTiming()
        self._writer: threading.Thread | None = None
        self._writer_error: SaveFailure | None = None
        self._writer_deadline = 0.0  # time.monotonic() by which the background write must be done
        self._writer_name = ""
        self._stalled = False  # a write outlasted --checkpoint-timeout-s: its thread is abandoned, not joined
        self.last_committed: str | None = None  # the name of the newest checkpoint this run committed
        self._snapshots: list[Snapshot] = []  # the asynchronous save's copies that before_update waits for
        self._host = HostSnapshots()
        self._side_group: Any = None  # the sharded writers' own gloo group, made at the first sharded save
        self.lease: CheckpointLease | None = None
        # Told, on every rank at the same point, of each checkpoint every rank knows to be committed (a launcher's
        # hook: Ray Train's report, trainer.on_ray): see Committed.
        self.on_commit: Callable[[Committed], None] | None = None
        self._unconfirmed: Committed | None = None  # the save launched last, until every rank knows its outcome
        self.committed_step: int | None = None  # the step of the newest save every rank knows committed (this run's)
        self.failed_in_a_row = 0  # periodic saves that failed on a storage error since the last that committed
        self._final_deadline: float | None = None  # rank 0's time.monotonic() by which a final save must commit
        self._final_attempt = 0

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
                                        self.log, job_named=identity.job_named)
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
                self._remove_leftovers()
            except CheckpointError as problem:
                error = SaveFailure(str(problem), is_transient(problem))
        self._raise_everywhere(error)

    def load(self, resume: str) -> LoadedCheckpoint | None:
        """Rank 0 finds and verifies the checkpoint to resume from and sends it to every rank."""
        outcome: LoadedCheckpoint | SaveFailure | None = None
        if self.runtime.is_main:
            try:
                found = self._find(resume)
                # Never the whole state to every rank: each reads what it holds from the files.
                outcome = None if found is None else found.for_every_rank()
            except CheckpointError as problem:  # StorageUnavailable where the storage failed: exit 200, retried
                outcome = SaveFailure(str(problem), is_transient(problem))
            except UnknownFormat as problem:
                outcome = SaveFailure(str(problem), transient=False)
        self.runtime.wait_for_all("rank 0 to read the checkpoint to resume from")
        outcome = broadcast_from_main(outcome, self.runtime)
        if isinstance(outcome, SaveFailure):
            raise (StorageUnavailable if outcome.transient else CheckpointError)(outcome.message)
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
        self._settle(self._wait_for_writer())
        self._final_deadline = final_deadline
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
            self._launch_writer(name, self._write_in_background, (name, raw, described, copies))
            if not self.config.async_checkpoint:
                failure = self._wait_for_writer()
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
            try:
                self._check_lease()
                opened = (self.storage.begin(name, self._generation()), None)
            except CheckpointError as problem:
                opened = (None, SaveFailure(str(problem), is_transient(problem)))
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
        self._launch_writer(name, self._write_sharded,
                            (name, temporary, tensors, split.layout, raw, described, copies, group))
        if not self.config.async_checkpoint:
            self._settle(self._wait_for_writer())

    def side_group(self) -> Any:
        """The checkpoint's own gloo group, made once on every rank (a collective): DCP's planning and the ranks'
        reports run on it, from the writer thread, apart from training's collectives. Its timeout is the save's
        (gloo's default, 30 minutes, would end a longer allowed save early). None without a process group."""
        if self._side_group is None and dist.is_initialized():
            self._side_group = dist.new_group(backend="gloo",
                                              timeout=timedelta(seconds=self.config.checkpoint_timeout_s))
        return self._side_group

    def _write_sharded(self, name: str, temporary: str, tensors: dict[str, torch.Tensor],
                       layout: dict[str, Any], raw: dict[str, Any], manifest_extra: dict[str, Any],
                       copies: list[Snapshot], group: Any) -> None:
        started = time.perf_counter()
        rank = self.runtime.identity.rank
        written = dcp_writer.Written({}, {})
        failure = None
        failed_before: BaseException | None = None
        try:
            self._on_writer_thread(copies)
        except Exception as error:  # noqa: BLE001 - this rank enters the save anyway: it fails there on every rank
            failed_before = error
        try:
            written = dcp_writer.save(tensors, layout, self.storage, temporary, rank, group, failed_before)
        except dcp_errors.RankFailed as failed:  # every rank learns it from DCP: each reports the same line
            failure = self._shard_failure(failed.rank, failed.error, temporary)
        except Exception as error:  # noqa: BLE001 - reported by rank 0; this thread must reach the gather
            failure = self._shard_failure(rank, error, temporary)
        reports: list[tuple[dcp_writer.Written, SaveFailure | None]] = [(written, failure)]
        try:
            if group is not None:
                everyone: list[Any] | None = ([None] * self.runtime.identity.world_size if self.runtime.is_main
                                              else None)
                dist.gather_object((written, failure), everyone, dst=0, group=group)
                reports = everyone or []
        except Exception as error:  # noqa: BLE001 - a save whose reports never arrived is a failed save
            # A rank that died ends the training's next collective anyway; one that was slow may do better next time.
            self._writer_error = SaveFailure(f"the ranks' reports of checkpoint {self.storage.describe(name)} did not "
                                             f"reach rank 0 ({' '.join(str(error).split())[:300]}). The previous "
                                             f"checkpoints are untouched", transient=True)
            if self.runtime.is_main:
                self.storage.abandon(temporary)
            return
        if not self.runtime.is_main:
            return
        try:
            failures = [report[1] for report in reports if report[1]]
            if failures:
                self.storage.abandon(temporary)
                self._writer_error = replace(failures[0], message=f"{failures[0].message}. The previous checkpoints "
                                                                  f"are untouched")
                return
            files = {filename: entry for report in reports for filename, entry in report[0].files.items()}
            items = {filename: offsets for report in reports for filename, offsets in report[0].items.items()}
            checksums = json.dumps(items, sort_keys=True).encode()
            self._write(name, raw, manifest_extra, started, temporary, files,
                        {dcp_items.ITEMS: lambda handle: handle.write(checksums)})
        except Exception as problem:  # noqa: BLE001 - reported to every rank by the next save or finish
            self._writer_error = self._failure_of(problem, name)

    def _shard_failure(self, rank: int, error: BaseException, temporary: str) -> SaveFailure:
        if isinstance(error, OSError):
            said = (f"rank {rank} could not write its shards into {self.storage.describe(temporary)} "
                    f"({self.storage.reason(error)})")
            if is_transient(error):  # an I/O error or a store's 5xx: the folder is right, the storage failed
                return SaveFailure(said, transient=True)
            return SaveFailure(f"{said}; sharded checkpoints need a --checkpoint-dir that every rank reaches (a "
                               f"shared file system or an object store)", transient=False)
        if isinstance(error, dcp_errors.Relayed):  # another rank's, known by its type's name and words
            said, transient = str(error), is_transient_type_name(str(error).split(":", 1)[0])
        else:
            said, transient = f"{type(error).__name__}: {error}", is_transient(error)
        return SaveFailure(f"rank {rank} could not write its shards: {' '.join(said.split())[:300]}", transient)

    def _take(self, state: Any, path: str, deferrable: Callable[[str], bool]) -> tuple[Any, list[Snapshot]]:
        """Under --async-checkpoint, the state as host copies (trainer.checkpoint.snapshot) and the copies to
        complete; else the state itself, written before training goes on."""
        if not self.config.async_checkpoint:
            return state, []
        snapshot = self._host.take(state, path, deferrable)
        self._snapshots.append(snapshot)
        return snapshot.state, [snapshot]

    def _on_writer_thread(self, copies: list[Snapshot]) -> None:
        """The writer thread's start: its CUDA device is the rank's (not device 0, where a context of its own
        would take memory on another rank's GPU), and the copies it writes have landed."""
        try:
            if self.runtime.device.type == "cuda":
                torch.cuda.set_device(self.runtime.device)
            for snapshot in copies:
                snapshot.complete()
        finally:
            for snapshot in copies:  # whatever failed: before_update must not wait for a copy that never comes
                snapshot.release()
        self.last_timing.copied_later_bytes = sum(snapshot.copied_later_bytes for snapshot in copies)

    def _launch_writer(self, name: str, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        # A daemon: a write stuck in a hung file system must not keep the process from exiting.
        self._writer = threading.Thread(target=target, args=args, name="checkpoint-writer", daemon=True)
        self._writer_deadline = time.monotonic() + self.config.checkpoint_timeout_s
        self._writer_name = name
        self._writer.start()

    def _stalled_message(self, name: str) -> str:
        return (f"checkpoint {self.storage.describe(name)} was not written within "
                f"{self.config.checkpoint_timeout_s:g}s (--checkpoint-timeout-s): the storage stopped answering (a "
                f"hung NFS mount or bucket?). The job stops so that it can be restarted; it resumes from the last "
                f"complete checkpoint, which is intact")

    def before_update(self) -> None:
        """Before the optimizer changes the parameters: an asynchronous save's copy of them is complete."""
        snapshots, self._snapshots = self._snapshots, []
        for snapshot in snapshots:
            snapshot.before_update()

    def finish(self) -> None:
        """Wait for a background write and settle its outcome on every rank (``_settle``)."""
        self._settle(self._wait_for_writer())

    def _confirm(self) -> None:
        """Every rank has just learnt that the save launched last committed (its error would have been raised):
        tell on_commit, once, with the checkpoint's location on rank 0."""
        committed, self._unconfirmed = self._unconfirmed, None
        if committed is None or self.on_commit is None:
            return
        if self.runtime.is_main and self.last_committed is not None:
            committed.location = self.storage.describe(self.last_committed)
        self.on_commit(committed)

    @property
    def stalled(self) -> bool:
        """Whether a write outlasted --checkpoint-timeout-s: the storage may not answer any more."""
        return self._stalled

    def release_lease(self, ending: str = FINISHED) -> None:
        """End this job's hold on the folder now, without waiting for a save in progress (an exit without one).
        Released, so that the next job starts at once; but where the launcher starts this job's workers again
        itself (``restarts_left``), a run that stops before its end keeps it for the next attempt, so that no other
        job takes the folder in between: stopped by a signal this rank received (a membership change of an elastic
        job looks the same as the launcher's own end), or failed (stopped by another rank's signal included: its
        launcher counts that exit as a failure) with restarts left. Kept, it is marked so and no longer renewed:
        another job may take it once it expires (--lease-expiry-s from now), and is told why it waits."""
        if self.lease is None:
            return
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

    def close(self, ending: str = FINISHED) -> None:
        """End the folder's lease (on rank 0; local, no collective; ``release_lease``): the next job may start at
        once. ``ending``: how the run ended (FINISHED, STOPPED by a signal, FAILED)."""
        if self._stalled:  # the storage does not answer: neither the write nor a release would end
            self.release_lease_within(RELEASE_AFTER_STALL_S, ending)
            return
        if self._writer is not None:
            # A save still being written belongs to this job's time in the folder, up to its deadline; past it,
            # the write is given up (_why_no_longer) and the lease released as after any stall.
            self._writer.join(max(0.0, self._writer_deadline - time.monotonic()))
            if self._writer.is_alive():
                self._stalled = True
                self.log.warning("%s", self._stalled_message(self._writer_name))
                self.release_lease_within(RELEASE_AFTER_STALL_S, ending)
                return
        self.release_lease_within(RELEASE_S, ending)  # a storage that hangs now must not keep a finished job alive

    def release_lease_within(self, seconds: float, ending: str = FINISHED) -> None:
        """End the lease from a thread given ``seconds``: the storage may be what hangs (a forced exit)."""
        releaser = threading.Thread(target=self.release_lease, args=(ending,), name="lease-release", daemon=True)
        releaser.start()
        releaser.join(seconds)

    def _write_in_background(self, name: str, state: dict[str, Any], manifest_extra: dict[str, Any],
                             copies: list[Snapshot]) -> None:
        try:
            self._on_writer_thread(copies)
            self._write(name, state, manifest_extra)
        except Exception as problem:  # noqa: BLE001 - reported to every rank by the next save or finish
            self._writer_error = self._failure_of(problem, name)

    def _failure_of(self, problem: Exception, name: str) -> SaveFailure:
        """A write's error as every rank is told of it: a CheckpointError says itself; a storage client's own error
        (botocore's, aiohttp's) is named with its words; anything else is a bug or a state that cannot be saved."""
        if isinstance(problem, CheckpointError):
            return SaveFailure(str(problem), is_transient(problem))
        if is_transient(problem):
            return SaveFailure(redact(f"could not write checkpoint {self.storage.describe(name)}: {described(problem)}"
                                      f". The previous checkpoints are untouched", self.storage.location), True)
        return SaveFailure(f"checkpoint write failed: {problem!r}", transient=False)

    def _wait_for_writer(self) -> SaveFailure | None:
        """The background write's failure, if any (stalled where it outlasted --checkpoint-timeout-s)."""
        if self._writer is not None:
            with self.runtime.busy(f"writing checkpoint {self._writer_name}"):
                self._writer.join(max(0.0, self._writer_deadline - time.monotonic()))
            if self._writer.is_alive():
                self._stalled = True
                return SaveFailure(self._stalled_message(self._writer_name), transient=False, stalled=True)
            self._writer = None
        failure, self._writer_error = self._writer_error, None
        return failure

    def _write(self, name: str, state: dict[str, Any], manifest_extra: dict[str, Any], started: float | None = None,
               temporary: str | None = None, shard_files: dict[str, dict[str, Any]] | None = None,
               more_files: dict[str, FileWriter] | None = None) -> None:
        """Write the state file and the manifest, commit, prune. A sharded save gives the temporary folder its
        ranks wrote their ``shard_files`` into (each one's size and crc32), and when it started."""
        started = time.perf_counter() if started is None else started
        shard_files = shard_files or {}
        written: dict[str, dict[str, Any]] = {}

        def make_manifest(files: dict[str, dict[str, Any]]) -> bytes:
            # Called once every other file is written, just before the manifest makes the folder a checkpoint:
            # the last moment to find that this write may no longer commit (storage.commit then removes it).
            reason = self._why_no_longer(name, unreadable_lease=LeaseUnreadable)  # unreadable: a retry may read it
            if reason:
                raise CheckpointError(f"checkpoint {self.storage.describe(name)} was not committed: {reason}")
            written.update(files)
            manifest = {"format": DCP_FORMAT if shard_files else FORMAT, **manifest_extra,
                        "created_unix": time.time(), "files": files}
            return json.dumps(manifest, indent=2).encode()

        try:
            self._check_lease()
        except CheckpointError:
            if temporary is not None:  # the ranks' shard files: not left in a folder another job now holds
                self.storage.abandon(temporary)
            raise
        # torch.save streams straight into the temporary file (through the checksum): no serialised copy
        # of the whole state in memory, no second pass to hash it.
        committed = self.storage.commit(temporary or self.storage.begin(name, self._generation()), name,
                                        {STATE_FILE: lambda handle: save_state(state, handle), **(more_files or {})},
                                        shard_files, make_manifest)
        self.last_timing.write_s = time.perf_counter() - started
        self.last_timing.bytes = sum(int(entry["bytes"]) for entry in written.values())
        sharded = (f" in {len(written)} files from {self.runtime.identity.world_size} rank(s)" if shard_files
                   else "")
        self.log.info("checkpoint %s written (%.1f MB%s in %.2fs)", self.storage.describe(committed),
                      self.last_timing.bytes / 1e6, sharded, self.last_timing.write_s)
        self.last_committed = committed
        try:
            reason = self._why_no_longer(name, unreadable_lease=LeaseUnreadable)
            if reason:  # committed by the time it was found: said as it is, and nothing older removed
                raise CheckpointError(f"checkpoint {self.storage.describe(committed)} was committed, but the older "
                                      f"ones were not pruned: {reason}")
            self._prune(written=committed)
        except LeaseUnreadable as problem:  # nothing is pruned on it, and the save stands: the next one prunes
            self.log.warning("checkpoint %s was committed; the older ones were not pruned: %s",
                             self.storage.describe(committed), problem)

    def _why_no_longer(self, name: str, unreadable_lease: type[Exception] | tuple[()] = ()) -> str | None:
        """Why this write may no longer commit or prune, or None. A write that outlasted --checkpoint-timeout-s was
        given up (the job was told it stalled, and may be gone, its lease released): if the storage answers again
        later, it must do neither. Nor may a write whose job lost the lease meanwhile, or cannot read it (raised
        instead where ``unreadable_lease`` is LeaseUnreadable)."""
        if self._stalled or time.monotonic() > self._writer_deadline:
            return (f"its write outlasted --checkpoint-timeout-s ({self.config.checkpoint_timeout_s:g}s) and was "
                    f"given up")
        try:
            self._check_lease()
        except unreadable_lease:
            raise
        except CheckpointError as lost:
            return str(lost)
        return None

    def _prune(self, written: str) -> None:
        """Keep the newest ``keep_last`` committed checkpoints up to the one just written and, optionally,
        the most accurate of them.

        Folders of later steps are left alone: they are either broken ones this run skipped when
        resuming (each is replaced when training reaches its step) or another history the user chose
        to leave with --resume PATH; counting them would delete this run's good fallbacks. An object store's
        saves each have a folder of their own: other folders of the written step are replaced by it, and of two
        committed ones of an older step (a crash came between a save and this removal) the later save is kept.
        """
        self._check_lease()  # never prune another job's checkpoints
        current = step_of(written) or 0
        try:
            listed = self.storage.list_checkpoints()
        except Exception as error:  # noqa: BLE001 - any backend's error: the save stands, the next one prunes
            self.log.warning("checkpoint %s was committed; the older ones were not pruned: cannot list %s (%s)",
                             self.storage.describe(written), self.storage.describe(),
                             redact(described(error), self.storage.location))
            return
        older = [name for name in listed if (step_of(name) or 0) <= current]
        replaced = {name for name in older if step_of(name) == current and name != written}
        committed: list[tuple[str, dict[str, Any]]] = []
        unsure: set[str] = set()
        for name in older:
            if name in replaced:
                continue
            whole, manifest = self._whole(name)
            if whole is None:
                unsure.add(name)  # the storage did not answer (throttled, timed out): left for the next save
                continue
            if not whole:
                continue  # never committed, or its files gone: not counted, and removed below as unusable
            if any(step_of(name) == step_of(later) for later, _ in committed):  # newest first: a later save is kept
                replaced.add(name)
                continue
            committed.append((name, manifest))
        kept = ({name for name, _ in committed[: self.config.keep_last]} | {written} | unsure) - replaced
        if self.config.keep_best and self.monitor is not None:
            best = _best(committed, self.monitor)
            if best is not None:
                kept.add(best)
        for name in older:
            if name in kept:
                continue
            try:
                self.storage.remove(name)
            except Exception as error:  # noqa: BLE001 - any backend's error: the next save tries again
                self.log.warning("could not remove old checkpoint %s: %s", self.storage.describe(name),
                                 redact(described(error), self.storage.location))

    def _check_lease(self) -> None:
        """CheckpointError if another job took the folder; LeaseUnreadable if the storage did not answer, after
        LEASE_READ_RETRIES_S: a hiccup is not a lost lease."""
        if self.lease is None:
            return
        for pause in (*LEASE_READ_RETRIES_S, None):
            try:
                self.lease.check()
                return
            except CheckpointError:
                raise
            except Exception as error:  # noqa: BLE001 - any backend's error: not confirmed, nothing commits on it
                if pause is None:
                    raise LeaseUnreadable(
                        f"could not read the lease of checkpoint folder {self.storage.describe()} "
                        f"({redact(described(error), self.storage.location)}, {len(LEASE_READ_RETRIES_S) + 1} "
                        f"tries), so this save cannot tell that the folder is still this job's") from None
                time.sleep(pause)

    def _generation(self) -> int:
        """This job's lease generation (0 without a lease): an object store's save folders are named after it."""
        return self.lease.generation or 0 if self.lease is not None else 0

    def _whole(self, name: str) -> tuple[bool | None, dict[str, Any]]:
        """Whether a folder holds a committed checkpoint whose files are all there (their sizes and checksums are
        ``verify``'s business), and its manifest: False without a readable manifest, or with a file it lists missing
        (a save committed in place whose files a later holder of the folder removed: it can never be whole); None
        where the storage did not answer (nothing is decided on that)."""
        try:
            if self.storage.size(name, MANIFEST) > MAX_MANIFEST_BYTES:
                return None, {}  # never read (verify refuses it too), nor removed: not what this trainer writes
            manifest = json.loads(self.storage.read(name, MANIFEST))
            present = set(self.storage.files(name))
        except (FileNotFoundError, ValueError):
            return False, {}
        except Exception:  # noqa: BLE001 - throttled, timed out, any backend's own error: unsure
            return None, {}
        listed = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(listed, dict) or not set(listed) <= present:
            return False, {}
        return True, manifest

    def _remove_leftovers(self) -> None:
        """At the start: what saves that crashed left. Where the storage does not answer, it is left for the next
        start (nothing is decided on an error)."""
        try:
            for stale in self.storage.remove_temporaries():
                self.log.warning("removed %s, left by a save that did not finish", self.storage.describe(stale))
            self._remove_unfinished_saves()
        except Exception as error:  # noqa: BLE001 - any backend's error (throttled, timed out)
            self.log.warning("left what earlier saves may have left in %s for the next start: cannot list it (%s)",
                             self.storage.describe(), redact(described(error), self.storage.location))

    def _remove_unfinished_saves(self) -> None:
        """At the start, on the lease's holder: an object store's save folders that will never be whole (no
        manifest, or files missing), left by a save that crashed or by a job that lost the folder meanwhile."""
        for name in self.storage.list_checkpoints():
            if saved_in_place(name) and self._whole(name)[0] is False:
                try:
                    self.storage.remove(name)
                    self.log.warning("removed %s, left by a save that did not finish", self.storage.describe(name))
                except Exception as error:  # noqa: BLE001 - any backend's error, as in _prune: the next start tries
                    self.log.warning("could not remove %s, left by a save that did not finish: %s",
                                     self.storage.describe(name), redact(described(error), self.storage.location))

    def _settle(self, failure: SaveFailure | None) -> None:
        """Every rank learns how the save launched last ended, from rank 0. Committed: on_commit is told. Failed on
        an error a retry cannot fix: CheckpointError (exit 2); stalled past --checkpoint-timeout-s: StorageStalled
        (exit 200). Failed on a storage error a retry may fix: a periodic save is one warning on every rank and
        training goes on, up to --max-failed-saves in a row (then StorageUnavailable, exit 200, naming the last
        committed checkpoint); a final save raises SaveRetry while rank 0's deadline leaves time for another try."""
        if self._unconfirmed is None:
            return  # no save outstanding (the same on every rank: set and cleared on all at once)
        self.runtime.wait_for_all("rank 0's checkpoint work")
        retry_s = None
        if self.runtime.is_main and failure is not None and failure.transient and self._final_deadline is not None:
            retry_s = self._final_retry_delay()
        last = self._last_committed_said() if self.runtime.is_main else ""
        failure, last, retry_s = broadcast_from_main((failure, last, retry_s), self.runtime)
        if failure is None:
            if self._unconfirmed is not None:
                self.committed_step = self._unconfirmed.step
            self.failed_in_a_row = 0
            self._final_attempt = 0
            self._confirm()
            return
        step = self._unconfirmed.step if self._unconfirmed is not None else None
        self._unconfirmed = None
        said = failure.message if self.runtime.is_main else f"rank 0 could not write the checkpoint: {failure.message}"
        if failure.stalled:
            raise StorageStalled(said)
        if not failure.transient:
            raise CheckpointError(said)
        at = f" at step {step}" if step is not None else ""
        if self._final_deadline is not None:
            if retry_s is not None:
                raise SaveRetry(f"the final checkpoint{at} was not saved: {said}; trying again in {retry_s:g}s",
                                retry_s)
            raise StorageUnavailable(f"the final checkpoint{at} was not saved, retried until its deadline: {said}. "
                                     f"{last}; the job ends to be restarted from it")
        self.failed_in_a_row += 1
        allowed = self.config.max_failed_saves
        if self.failed_in_a_row >= allowed:
            raise StorageUnavailable(f"{self.failed_in_a_row} checkpoint save(s) in a row failed (--max-failed-saves "
                                     f"{allowed}), the last{at}: {said}. {last}; the job ends to be restarted "
                                     f"from it")
        self.log.warning("checkpoint%s not saved (%d of --max-failed-saves %d in a row): %s. Training goes on; the "
                         "next save tries again. %s", at, self.failed_in_a_row, allowed, said, last)

    def _final_retry_delay(self) -> float | None:
        """On rank 0: the pause before a failed final save's next try, or None if its deadline leaves no time."""
        assert self._final_deadline is not None
        delay = FINAL_SAVE_BACKOFF_S[min(self._final_attempt, len(FINAL_SAVE_BACKOFF_S) - 1)]
        if time.monotonic() + delay >= self._final_deadline:
            return None
        self._final_attempt += 1
        return delay

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
            kind = StorageUnavailable if failure.transient else CheckpointError
            if self.runtime.is_main:
                raise kind(failure.message)
            raise kind(f"rank 0 could not use the checkpoint folder: {failure.message}")


def save_state(state: dict[str, Any], handle: Any) -> None:
    """torch.save without its own CRC-32 of every record (a zip field no loader checks): the manifest's CRC-32
    of the whole file guards the same bytes, and the second pass cost 0.03 s per 134 MB on 2 cores."""
    with serialization_config.patch({"save.compute_crc32": False}):
        torch.save(state, handle)


def _best(committed: list[tuple[str, dict[str, Any]]], monitor: Monitor) -> str | None:
    """The checkpoint with the best value of the monitored metric in its manifest (format 2: test_accuracy)."""
    scored = []
    for name, manifest in committed:
        metrics = manifest.get("metrics") if isinstance(manifest.get("metrics"), dict) else {}
        if manifest.get("format") == 2 and "test_accuracy" in manifest:
            metrics = {"accuracy": manifest["test_accuracy"]}
        value = metrics.get(monitor.metric)
        if isinstance(value, int | float) and not isinstance(value, bool):
            scored.append((value if monitor.mode == "max" else -value, step_of(name) or 0, name))
    return max(scored)[2] if scored else None
