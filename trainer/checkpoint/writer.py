"""The checkpoint writer: the thread that writes a save (rank 0's state file, every rank's DCP shards), commits it
with its manifest once the lease confirms the folder is still this job's, prunes older ones, and reports how it
ended (a SaveFailure) to the manager, which tells every rank. A write that outlasts --checkpoint-timeout-s is given
up: its thread is abandoned, never joined, and it may neither commit nor prune if the storage answers later."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.serialization import config as serialization_config

from trainer.checkpoint import dcp_errors, dcp_items, dcp_writer
from trainer.checkpoint.lease import CheckpointLease, LeaseUnreadable
from trainer.checkpoint.reading import STATE_FILE
from trainer.checkpoint.retention import Retention
from trainer.checkpoint.save_failures import SaveFailure, is_transient
from trainer.checkpoint.schema import DCP_FORMAT, FORMAT
from trainer.checkpoint.snapshot import Snapshot
from trainer.checkpoint.storage import CheckpointStorage, FileWriter
from trainer.config import CheckpointConfig
from trainer.distributed import Runtime
from trainer.errors import CheckpointError, described
from trainer.redact import redact


@dataclass
class SaveTiming:
    write_s: float = 0.0  # serialise + checksum + write + fsync + commit
    bytes: int = 0
    copied_later_bytes: int = 0  # an asynchronous save's tensors copied after save() returned
    created_unix: float = 0.0  # its manifest's: when it was committed, in Unix time


class CheckpointWriter:
    def __init__(self, storage: CheckpointStorage, config: CheckpointConfig, runtime: Runtime, log: logging.Logger,
                 retention: Retention) -> None:
        self.storage = storage
        self.config = config
        self.runtime = runtime
        self.log = log
        self.retention = retention
        self.lease: CheckpointLease | None = None  # the folder's, on rank 0 once taken (CheckpointManager.prepare)
        self.last_timing = SaveTiming()
        self.last_committed: str | None = None  # the name of the newest checkpoint this run committed
        self.thread: threading.Thread | None = None
        self.error: SaveFailure | None = None
        self.deadline = 0.0  # time.monotonic() by which the background write must be done
        self.name = ""
        self.stalled = False  # a write outlasted --checkpoint-timeout-s: its thread is abandoned, not joined

    def launch(self, name: str, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        # A daemon: a write stuck in a hung file system must not keep the process from exiting.
        self.thread = threading.Thread(target=target, args=args, name="checkpoint-writer", daemon=True)
        self.deadline = time.monotonic() + self.config.checkpoint_timeout_s
        self.name = name
        self.thread.start()

    def wait(self) -> SaveFailure | None:
        """The background write's failure, if any (stalled where it outlasted --checkpoint-timeout-s)."""
        if self.thread is not None:
            with self.runtime.busy(f"writing checkpoint {self.name}"):
                self.thread.join(max(0.0, self.deadline - time.monotonic()))
            if self.thread.is_alive():
                self.stalled = True
                return SaveFailure(self.stalled_message(self.name), transient=False, stalled=True)
            self.thread = None
        failure, self.error = self.error, None
        return failure

    def stalled_message(self, name: str) -> str:
        return (f"checkpoint {self.storage.describe(name)} was not written within "
                f"{self.config.checkpoint_timeout_s:g}s (--checkpoint-timeout-s): the storage stopped answering (a "
                f"hung NFS mount or bucket?). The job stops so that it can be restarted; it resumes from the last "
                f"complete checkpoint, which is intact")

    def write_whole(self, name: str, state: dict[str, Any], manifest_extra: dict[str, Any],
                             copies: list[Snapshot]) -> None:
        try:
            self._on_writer_thread(copies)
            self.commit(name, state, manifest_extra)
        except Exception as problem:  # noqa: BLE001 - reported to every rank by the next save or finish
            self.error = self._failure_of(problem, name)

    def write_sharded(self, name: str, temporary: str, tensors: dict[str, torch.Tensor],
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
            # No storage error: a rank is gone, or the save's own group timed out (and may not work again). The job
            # ends to be restarted, as for any lost rank.
            self.error = SaveFailure(f"the ranks' reports of checkpoint {self.storage.describe(name)} did not "
                                     f"reach rank 0 ({' '.join(str(error).split())[:300]}). The previous "
                                     f"checkpoints are untouched", transient=False, peer_lost=True)
            if self.runtime.is_main:
                self.storage.abandon(temporary)
            return
        if not self.runtime.is_main:
            return
        try:
            failures = [report[1] for report in reports if report[1]]
            if failures:
                self.storage.abandon(temporary)
                self.error = replace(failures[0], message=f"{failures[0].message}. The previous checkpoints "
                                                                  f"are untouched")
                return
            files = {filename: entry for report in reports for filename, entry in report[0].files.items()}
            items = {filename: offsets for report in reports for filename, offsets in report[0].items.items()}
            checksums = json.dumps(items, sort_keys=True).encode()
            self.commit(name, raw, manifest_extra, started, temporary, files,
                        {dcp_items.ITEMS: lambda handle: handle.write(checksums)})
        except Exception as problem:  # noqa: BLE001 - reported to every rank by the next save or finish
            self.error = self._failure_of(problem, name)

    def _shard_failure(self, rank: int, error: BaseException, temporary: str) -> SaveFailure:
        if isinstance(error, OSError):
            said = (f"rank {rank} could not write its shards into {self.storage.describe(temporary)} "
                    f"({self.storage.reason(error)})")
            if is_transient(error):  # an I/O error or a store's 5xx: the folder is right, the storage failed
                return SaveFailure(said, transient=True)
            return SaveFailure(f"{said}; sharded checkpoints need a --checkpoint-dir that every rank reaches (a "
                               f"shared file system or an object store)", transient=False)
        # Another rank's (dcp_errors.Relayed) says itself, and whether a retry may fix it.
        said = str(error) if isinstance(error, dcp_errors.Relayed) else f"{type(error).__name__}: {error}"
        transient = is_transient(error)
        return SaveFailure(f"rank {rank} could not write its shards: {' '.join(said.split())[:300]}", transient)

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

    def _failure_of(self, problem: Exception, name: str) -> SaveFailure:
        """A write's error as every rank is told of it: a CheckpointError says itself; a storage client's own error
        (botocore's, aiohttp's) is named with its words; anything else is a bug or a state that cannot be saved."""
        if isinstance(problem, CheckpointError):
            return SaveFailure.of(problem)
        if is_transient(problem):
            return SaveFailure(redact(f"could not write checkpoint {self.storage.describe(name)}: {described(problem)}"
                                      f". The previous checkpoints are untouched", self.storage.location), True)
        return SaveFailure(f"checkpoint write failed: {problem!r}", transient=False)

    def commit(self, name: str, state: dict[str, Any], manifest_extra: dict[str, Any], started: float | None = None,
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
            self.last_timing.created_unix = time.time()
            manifest = {"format": DCP_FORMAT if shard_files else FORMAT, **manifest_extra,
                        "created_unix": self.last_timing.created_unix, "files": files}
            return json.dumps(manifest, indent=2).encode()

        try:
            self.check_lease()
        except CheckpointError:
            if temporary is not None:  # the ranks' shard files: not left in a folder another job now holds
                self.storage.abandon(temporary)
            raise
        # torch.save streams straight into the temporary file (through the checksum): no serialised copy
        # of the whole state in memory, no second pass to hash it.
        committed = self.storage.commit(temporary or self.storage.begin(name, self.generation()), name,
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
            self.retention.prune(written=committed)
        except LeaseUnreadable as problem:  # nothing is pruned on it, and the save stands: the next one prunes
            self.log.warning("checkpoint %s was committed; the older ones were not pruned: %s",
                             self.storage.describe(committed), problem)

    def _why_no_longer(self, name: str, unreadable_lease: type[Exception] | tuple[()] = ()) -> str | None:
        """Why this write may no longer commit or prune, or None. A write that outlasted --checkpoint-timeout-s was
        given up (the job was told it stalled, and may be gone, its lease released): if the storage answers again
        later, it must do neither. Nor may a write whose job lost the lease meanwhile, or cannot read it (raised
        instead where ``unreadable_lease`` is LeaseUnreadable)."""
        if self.stalled or time.monotonic() > self.deadline:
            return (f"its write outlasted --checkpoint-timeout-s ({self.config.checkpoint_timeout_s:g}s) and was "
                    f"given up")
        try:
            self.check_lease()
        except unreadable_lease:
            raise
        except CheckpointError as lost:
            return str(lost)
        return None

    def check_lease(self) -> None:
        """CheckpointError if another job took the folder; LeaseUnreadable if the storage did not answer, after a
        few reads (CheckpointLease.confirm): a hiccup is not a lost lease."""
        if self.lease is not None:
            self.lease.confirm()

    def generation(self) -> int:
        """This job's lease generation (0 without a lease): an object store's save folders are named after it."""
        return self.lease.generation or 0 if self.lease is not None else 0


def save_state(state: dict[str, Any], handle: Any) -> None:
    """torch.save without its own CRC-32 of every record (a zip field no loader checks): the manifest's CRC-32
    of the whole file guards the same bytes, and the second pass cost 0.03 s per 134 MB on 2 cores."""
    with serialization_config.patch({"save.compute_crc32": False}):
        torch.save(state, handle)


