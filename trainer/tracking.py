"""Experiment trackers (--tracker mlflow,wandb): what rank 0 also tells an MLflow server or Weights & Biases,
beside metrics.jsonl and TensorBoard.

One seam: a tracker is a ``Tracker`` in a module of its own (trainer/trackers/), registered in
trainer.seams.TRACKERS under the name --tracker takes. It is told where its run starts (a new one, or the
checkpoint's to continue), each record of metrics, the summary, the newest checkpoint if asked, and how the run
ended. What every tracker gets from this module, so that none has to do it itself:

- Only rank 0 talks to a tracker; the other ranks hold a Tracking that does nothing.
- The start is bounded by --tracker-timeout-s, and its failure is one line (TrackerError, exit 2, on every rank:
  the caller agrees on it), before the first step.
- After the start, each tracker is called from a thread of its own, in order: training never waits for a network.
  A tracker that fails then is reported once, as a warning, and told nothing more; the run goes on and
  metrics.jsonl keeps every record.
- Each tracker's run id is a checkpoint part ("trackers"): a run resumed after a preemption, at any world size,
  continues the same tracker run instead of starting a second one.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint.parts import RestoreContext, StatePart
from trainer.config import TrackingConfig
from trainer.errors import Preempted, TrackerError, first_line
from trainer.redact import redact
from trainer.seams import TRACKERS

__all__ = ["FAILED", "FINISHED", "KILLED", "TRACKERS", "CheckpointFiles", "Tracker", "TrackerRun", "Tracking",
           "flat_params"]

# How a run ended, in MLflow's words (W&B's tracker turns them into exit codes).
FINISHED, KILLED, FAILED = "FINISHED", "KILLED", "FAILED"
QUEUED_CALLS = 10_000  # a tracker's calls waiting for its thread: hours of log steps, a few MB of records


@dataclass(frozen=True)
class TrackerRun:
    """What a tracker is told at its start."""

    experiment: str  # --experiment; "" leaves the tracker's own default (its environment, then "ddp-deploy")
    name: str  # the run's display name
    resume_id: str | None  # the checkpoint's run of this tracker, to continue; None: a new run
    params: dict[str, Any]  # the run's config and task, redacted, nested as config.yaml has them
    output_dir: Path
    settings: TrackingConfig
    # A new run started from another job's or folder's checkpoint: that run's id, recorded in the new one.
    forked_from: str | None = None
    # The optimizer step the checkpoint being resumed was written at (None: a fresh start). A run that logged
    # later steps before it crashed logs them again from here: the tracker records that rollback.
    resumed_at_step: int | None = None


@dataclass(frozen=True)
class CheckpointFiles:
    """A committed checkpoint, read through its storage (a local folder or a bucket alike)."""

    name: str  # "step-00000120"
    files: tuple[str, ...]
    read: Callable[[str], bytes]


class Tracker(ABC):
    """One experiment tracker. ``start`` runs on the training thread, bounded by --tracker-timeout-s; every other
    call runs on the tracker's own thread, in order. Any exception is handled by Tracking: at the start it ends
    the run with one line, afterwards it is a warning."""

    def load(self) -> None:  # noqa: B027 - optional: for trackers with a client library to import
        """Import the client library, before ``start`` and outside --tracker-timeout-s: an import takes seconds on
        a busy node (MLflow's 2 s on an idle one here), and the timeout is the tracker's to answer in. (An import
        that blocks for good, on a hung network mount, then holds rank 0 until the collective timeout.)"""

    @abstractmethod
    def start(self, run: TrackerRun, log: logging.Logger) -> str:
        """Connect, create or continue the run, record its parameters; the run's id (saved in checkpoints)."""

    @abstractmethod
    def log_metrics(self, kind: str, step: int, values: Mapping[str, float], made_at: float) -> None:
        """One record of metrics.jsonl: ``kind`` "train" or "test", at optimizer step ``step``, made at ``made_at``
        (time.time(): the tracker's thread may send it much later)."""

    @abstractmethod
    def log_summary(self, summary: Mapping[str, float], files: tuple[Path, ...]) -> None:
        """The run's final numbers (summary.json's), and its config.yaml and summary.json files."""

    def log_checkpoint(self, checkpoint: CheckpointFiles) -> None:  # noqa: B027 - optional: most keep none
        """The newest checkpoint, when --tracker-checkpoints asks (trackers that keep files)."""

    @abstractmethod
    def end(self, status: str) -> None:
        """Mark the run FINISHED, KILLED (preempted: a resume continues it) or FAILED, and let go of it."""

    def describe(self) -> str:
        """Where the tracker sends its records, for log lines (redacted by the caller)."""
        return ""


def flat_params(nested: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"optim": {"lr": 0.1}}`` as ``{"optim.lr": "0.1"}``: for trackers whose parameters are flat strings."""
    flat: dict[str, str] = {}
    for key, value in nested.items():
        if isinstance(value, Mapping):
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


def _missing_library(name: str, error: ImportError) -> TrackerError:
    return TrackerError(f"--tracker {name} needs its client library ({first_line(error)}); install it with pip "
                        f"install 'ddp-deploy[{name}]'")


class _Channel:
    """One tracker's thread: its calls run in the order sent, off the training thread. The first failure is
    warned about once, and the tracker is told nothing more in this run but its end (a server that was down
    for a moment would otherwise keep the run RUNNING for ever). At most ``limit`` calls wait: a tracker
    that hangs (MLflow's client retries one call for about 20 minutes by default) must not grow the training
    process's memory without end; what does not fit is dropped, with one warning."""

    def __init__(self, name: str, log: logging.Logger) -> None:
        self.name = name
        self.log = log
        self.failed = False
        self.dropped = 0
        # Each call, what it does (for the warning), and whether it is sent even after a failure (the end).
        self._calls: queue.Queue[tuple[Callable[[], None], str, bool] | None] = queue.Queue(maxsize=QUEUED_CALLS)
        self._thread = threading.Thread(target=self._serve, name=f"tracker-{name}", daemon=True)
        self._thread.start()

    def send(self, call: Callable[[], None], what: str) -> None:
        if self.failed:
            return
        try:
            self._calls.put_nowait((call, what, False))
        except queue.Full:
            if not self.dropped:
                self.log.warning("tracker %s is %d calls behind (hung?): what does not fit is dropped until it catches "
                                 "up; metrics.jsonl has every record", self.name, self._calls.maxsize)
            self.dropped += 1

    def send_last(self, call: Callable[[], None], what: str, deadline: float) -> bool:
        """The run's end: sent even after a failure, and waiting for room in the queue until ``deadline``."""
        try:
            self._calls.put((call, what, True), timeout=max(0.0, deadline - time.monotonic()))
            return True
        except queue.Full:
            return False

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            call, what, even_after_a_failure = item
            if self.failed and not even_after_a_failure:
                continue
            try:
                call()
            except Exception as error:  # a tracker's failure must never reach training
                if self.failed:
                    continue  # warned about once already
                self.failed = True
                self.log.warning("tracker %s failed while %s (%s); training goes on without it, and metrics.jsonl "
                                 "has every record", self.name, what, redact(first_line(error)))

    def close(self, deadline: float) -> int:
        """Let the thread finish what was sent, until ``deadline`` (time.monotonic()); how many calls were left."""
        try:
            self._calls.put(None, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            return self._calls.qsize()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return self._calls.qsize() + 1 if self._thread.is_alive() else 0


class Tracking:
    """The run's trackers: started once the run goes ahead, fed each metrics record, ended with the run."""

    def __init__(self, config: TrackingConfig, output_dir: Path, enabled: bool, log: logging.Logger) -> None:
        self.config = config
        self.output_dir = output_dir
        self.enabled = enabled and bool(config.trackers)  # rank 0, and some tracker asked for
        self.log = log
        self.run_ids: dict[str, str] = {}  # by tracker name: what checkpoints keep
        self._origin: str | None = None  # the output folder of the run that wrote the checkpoint (None: unknown)
        self._inherited: dict[str, str] = {}  # the checkpoint's runs, by tracker: a fork records where it came from
        self._trackers: dict[str, Tracker] = {}
        self._channels: dict[str, _Channel] = {}

    # -- the checkpoint part -------------------------------------------------------------------------------
    def state_part(self) -> StatePart:
        """The tracker runs' ids, kept by every checkpoint (a run without --tracker keeps those it resumed with),
        with the output folder they belong to: a run continues them only in that folder. (Not by the job's name:
        torchrun --standalone names each relaunch anew, and a job's restarts and relaunches are one run.)"""
        def capture() -> dict[str, Any]:
            return {"runs": dict(self.run_ids), "output_dir": self._folder()}

        def restore(saved: dict[str, Any], _: RestoreContext) -> None:
            self._origin = saved["output_dir"]
            self._inherited = dict(saved["runs"])
            if self._fork_of() is None:  # another folder's runs are never this folder's to keep or continue
                self.run_ids.update(saved["runs"])

        def upgrade(version: int, saved: Any) -> dict[str, Any]:
            # Version 0 (before trackers): no run. Version 1 (the ids alone): whose they were is unknown, and
            # they are continued, as that version did.
            return {"runs": dict(saved) if version == 1 else {}, "output_dir": None}

        return StatePart("trackers", capture, restore, version=2, upgrade=upgrade)

    def _folder(self) -> str:
        return str(self.output_dir.resolve())

    def _fork_of(self) -> str | None:
        """Why the checkpoint's runs are not this run's to continue (it was written in another output folder: a
        fine-tune, or a sweep from one checkpoint), or None."""
        if self._origin is not None and self._origin != self._folder():
            return f"the checkpoint was written by a run in {self._origin}"
        return None

    # -- start ---------------------------------------------------------------------------------------------
    def start(self, params: dict[str, Any], resumed_at_step: int | None = None) -> None:
        """Rank 0 starts each tracker, or continues the checkpoint's run of it; TrackerError if one cannot.
        The caller agrees on the outcome across ranks (trainer.distributed.agreed)."""
        if not self.enabled:
            return
        name = self.config.run_name or self.output_dir.resolve().name
        fork = self._fork_of()
        for tracker_name in self.config.trackers:
            tracker: Tracker = TRACKERS.get(tracker_name)()
            resume_id, forked_from = self.run_ids.get(tracker_name), None
            if fork is not None and tracker_name in self._inherited:
                forked_from = self._inherited[tracker_name]
                self.log.info("tracker %s: a new run, which records that it started from run %s (%s)", tracker_name,
                              forked_from, redact(fork))
            run = TrackerRun(self.config.experiment, name, resume_id, params, self.output_dir, self.config,
                             forked_from, resumed_at_step)
            try:
                tracker.load()
            except ImportError as error:
                raise _missing_library(tracker_name, error) from None
            except Exception as error:  # a broken install (protobuf's "Descriptors cannot be created directly")
                raise TrackerError(f"--tracker {tracker_name}: its client library fails to load "
                                   f"({type(error).__name__}: {first_line(error)}); repair it (pip install "
                                   f"'ddp-deploy[{tracker_name}]') or run without --tracker {tracker_name}") from None
            run_id = self._within_timeout(tracker_name, tracker, lambda t=tracker, r=run: t.start(r, self.log))
            continued = "continues" if run_id == resume_id else "started"
            self.log.info("tracker %s: %s run %s%s", tracker_name, continued, run_id,
                          f" ({redact(tracker.describe())})" if tracker.describe() else "")
            self.run_ids[tracker_name] = run_id
            self._trackers[tracker_name] = tracker
            self._channels[tracker_name] = _Channel(tracker_name, self.log)

    def _within_timeout(self, name: str, tracker: Tracker, start: Callable[[], str]) -> str:
        """``start()`` in a thread, given --tracker-timeout-s: a tracker that retries for minutes (MLflow's client
        does, by default) must not hold every rank before the first step."""
        outcome: list[Any] = []

        def attempt() -> None:
            try:
                outcome.append(start())
            except BaseException as error:  # noqa: BLE001 - carried to the training thread
                outcome.append(error)

        thread = threading.Thread(target=attempt, name=f"tracker-{name}-start", daemon=True)
        thread.start()
        thread.join(self.config.tracker_timeout_s)
        where = f" at {tracker.describe()}" if tracker.describe() else ""
        if not outcome:
            raise TrackerError(redact(f"--tracker {name}: no answer{where} within {self.config.tracker_timeout_s:g} s; "
                                      f"start the tracker or fix its address, raise --tracker-timeout-s, or run "
                                      f"without --tracker {name}"))
        result = outcome[0]
        if isinstance(result, TrackerError):
            raise result
        if isinstance(result, ImportError):
            raise _missing_library(name, result) from None
        if isinstance(result, BaseException):
            raise TrackerError(redact(f"--tracker {name}{where} refused the run ({first_line(result)}); fix the "
                                      f"tracker's settings or run without --tracker {name}")) from None
        return str(result)

    # -- records -------------------------------------------------------------------------------------------
    def log_metrics(self, kind: str, step: int, values: Mapping[str, float]) -> None:
        record, made_at = dict(values), time.time()  # the caller's dict may change before the thread reads it
        for name, channel in self._channels.items():
            channel.send(lambda t=self._trackers[name]: t.log_metrics(kind, step, record, made_at),
                         f"logging step {step}")

    # -- end -----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def run(self, end_by: Callable[[], float | None] = lambda: None) -> Iterator[Tracking]:
        """Ends the trackers' runs with the training's outcome: FINISHED, KILLED when preempted (a resume continues
        it), FAILED otherwise. A summary and checkpoint sent within are delivered before the end, unless
        ``end_by()`` (a time.monotonic(): a preempted process's grace period) comes first."""
        status = FAILED
        try:
            yield self
            status = FINISHED
        except Preempted:
            status = KILLED
            raise
        finally:
            self.close(status, end_by())

    def log_summary(self, summary: Mapping[str, Any], files: tuple[Path, ...]) -> None:
        numbers = {key: value for key, value in summary.items()
                   if isinstance(value, int | float) and not isinstance(value, bool)}
        for name, channel in self._channels.items():
            channel.send(lambda t=self._trackers[name]: t.log_summary(numbers, files), "sending the summary")

    def log_checkpoint(self, checkpoint: CheckpointFiles | None) -> None:
        """--tracker-checkpoints: the newest checkpoint to the trackers that keep files."""
        if checkpoint is None:
            return
        for name, channel in self._channels.items():
            channel.send(lambda t=self._trackers[name]: t.log_checkpoint(checkpoint),
                         f"uploading checkpoint {checkpoint.name}")

    def close(self, status: str, end_by: float | None = None) -> None:
        """Send the end, then give the trackers --tracker-timeout-s, all together, to finish what they were sent;
        less if ``end_by`` (time.monotonic()) comes first: a preempted process must exit within its grace
        period, trackers included, before the launcher's SIGKILL."""
        deadline = time.monotonic() + self.config.tracker_timeout_s
        limit = f"{self.config.tracker_timeout_s:g} s (--tracker-timeout-s)"
        if end_by is not None and end_by < deadline:
            deadline = end_by
            limit = "the grace period after the stop signal (--grace-period-s)"
        unsent = {name: not channel.send_last(lambda t=self._trackers[name]: t.end(status),
                                              f"ending its run ({status})", deadline)
                  for name, channel in self._channels.items()}
        for name, channel in self._channels.items():
            left = channel.close(deadline) + unsent[name]
            dropped = f"; {channel.dropped} record(s) were dropped while it was behind" if channel.dropped else ""
            if left:
                self.log.warning("tracker %s did not take its last %d call(s) within %s%s; metrics.jsonl has every "
                                 "record", name, left, limit, dropped)
            elif dropped:
                self.log.warning("tracker %s ended its run%s; metrics.jsonl has every record", name, dropped)
        self._channels.clear()
