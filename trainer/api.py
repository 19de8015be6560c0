"""The Python API: ``trainer.run``, the code path of ``ddp-train`` and ``python -m trainer`` too.

A user's script, started by any launcher exactly as ``trainer/main.py`` is::

    import sys
    import trainer
    from forecast import Forecast

    sys.exit(trainer.run(Forecast, epochs=5))    # --config and command-line flags still apply, and win

``run`` reads who this process is from the launcher's environment, joins the group, trains, always
tears down, and returns the exit code the launcher should see (0, or one of trainer.errors' codes).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.build import build_training
from trainer.checkpoint import CheckpointManager, Committed, Monitor
from trainer.checkpoint.manager import FAILED, FINISHED, STOPPED
from trainer.cli import dump_yaml, layout, parse_config
from trainer.config import Config
from trainer.cuda_driver import driver_check, working_cuda_warning
from trainer.distributed import (
    Runtime,
    agreed,
    choose_backend,
    choose_device,
    gather_to_main,
    process_group,
    threads_per_rank,
)
from trainer.errors import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_PEER_LOST,
    EXIT_PREEMPTED,
    CheckpointError,
    OutputError,
    PeerLost,
    Preempted,
    TrackerError,
    UserError,
    described,
    first_line,
    user_message,
)
from trainer.flight_recorder import apply_recorder_environment, dump_flight_recorder, reading_advice
from trainer.gpu import apply_nccl_environment, checkpoint_layout, nccl_timeout_advice, peak_memory
from trainer.launchers import StatusServer, identity_from_env, status_server_from_env
from trainer.liveness import PROGRESS_GRACE_S
from trainer.loop import Trainer
from trainer.preemption import FORCED_EXIT_CLEANUP_S, PreemptionWatcher, StopRequests
from trainer.prometheus import MetricsEndpoint
from trainer.redact import redact, redacted
from trainer.report import final_line, seconds_since_process_start, setup_logging, write_summary, writing
from trainer.resume import check_resume
from trainer.task import RunTask
from trainer.tracking import CheckpointFiles, Tracking
from trainer.trainjob_progress import Plan, TrainJobProgress

__all__ = ["checkpoint_written", "run", "train"]

# --tracker-checkpoints' look at the run's last checkpoint after training: it must not hold the end of the run.
CHECKPOINT_LOOKUP_S = 10.0

# What gloo and NCCL say when a peer process is gone; such an error is the other rank's story, not this one's.
PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|Connection refused|"
                       r"NCCL communicator was aborted|Timed out waiting|timed out|timeout caused pair closure|"
                       r"DistNetworkError", re.IGNORECASE)


# gloo's ("Timed out waiting 2000ms for recv operation"), NCCL's watchdog's and the store's words for an
# operation between ranks that ran past its timeout (a peer that is gone says otherwise: connection closed).
# When one gloo operation times out, gloo closes every pair of the context and the operations still waiting
# on them (a DDP buffer broadcast, say) fail with "Application timeout caused pair closure": a timeout too.
TIMED_OUT = re.compile(r"Timed out waiting|Watchdog caught collective operation timeout|wait timeout|Socket Timeout|"
                       r"timeout caused pair closure", re.IGNORECASE)


def run(task: str | type | None = None, argv: Sequence[str] | None = None, *,
        on_commit: Callable[[Committed], None] | None = None, stop_requests: StopRequests | None = None,
        **settings: Any) -> int:
    """Train ``task`` (a task class, a built-in's name or ``package.module:Class``; None: from --task).

    ``settings`` are config values as in the YAML file (``epochs=5``, ``optim={"lr": 0.01}``, a task's
    options): the script's defaults, which a --config file and then the command line (``argv``, default
    sys.argv[1:]) override. ``on_commit``: a launcher's hook, called on every rank at the same point once every
    rank knows a checkpoint committed (trainer.on_ray reports it to Ray Train). ``stop_requests``: where a launcher
    asks for a stop as SIGTERM does, from any thread (trainer.on_ray.drain: the worker's node drains): a checkpoint
    at the next step and EXIT_PREEMPTED. Returns the exit code.
    """
    rank = os.environ.get("RANK", "0")
    prog = Path(sys.argv[0]).name if task is not None else "ddp-train"
    try:
        config, chosen = parse_config(argv, task=task, settings=settings, prog=prog)
        identity = identity_from_env(os.environ, master_port=config.dist.master_port, job_id=config.dist.job_id)
        rank = str(identity.rank)
        device = choose_device(config.dist, identity)
        # On a GPU too: the host side of a step (gathering a batch, pinning it) runs on these threads.
        torch.set_num_threads(threads_per_rank(config.dist, identity, dict(os.environ)))
        if identity.distributed:  # read when the process group is created: set before joining
            apply_recorder_environment(os.environ, config.output.output_dir)
            if choose_backend(config.dist, device) == "nccl":
                apply_nccl_environment(os.environ)
        with process_group(config.dist, identity, device) as runtime:
            train(config, chosen, runtime, on_commit, status_server_from_env(os.environ), stop_requests)
        return EXIT_OK
    except UserError as error:
        retry = (f"; exiting with {EXIT_PEER_LOST} so the launcher restarts the job from its last checkpoint"
                 if error.exit_code == EXIT_PEER_LOST else "")
        print(f"[rank {rank}] error: {redact(user_message(error))}{retry}", file=sys.stderr, flush=True)
        return error.exit_code
    except RuntimeError as error:
        first = first_line(error)
        if not (isinstance(error, torch.distributed.DistError) or PEER_LOST.search(first)):
            raise
        print(f"[rank {rank}] error: lost contact with another rank ({redact(first[:300])}); it probably crashed or "
              f"was stopped, and its own log says why. Checkpoints are intact; exiting with {EXIT_PEER_LOST} so "
              f"the launcher can restart the job", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    except Preempted as stopped:
        print(f"[rank {rank}] {stopped}; exiting with {EXIT_PREEMPTED} so the launcher retries", file=sys.stderr,
              flush=True)
        return EXIT_PREEMPTED


def _timeout_advice(runtime: Runtime) -> str:
    """Where this rank's flight recorder went (written now, on any backend), and NCCL's own log."""
    dumped = dump_flight_recorder(os.environ, runtime.identity.rank)
    advice = f"; {reading_advice(dumped.parent)}" if dumped is not None else ""
    return advice + (f"; {nccl_timeout_advice()}" if runtime.backend == "nccl" else "")


def _exit_stuck(runtime: Runtime, diagnosis: str, checkpoints: CheckpointManager) -> None:
    """The progress watchdog's end of a rank whose main thread is stuck (trainer.liveness): the diagnosis and
    the flight recorder's dump, the lease released if it can be within seconds, then exit 200 at once (the main
    thread cannot be unwound: it waits in the device or in a collective that never ends)."""
    print(f"[rank {runtime.identity.rank}] error: {redact(diagnosis + _timeout_advice(runtime))}; exiting with "
          f"{EXIT_PEER_LOST} so the launcher restarts the job from its last checkpoint", file=sys.stderr, flush=True)
    checkpoints.release_lease_within(FORCED_EXIT_CLEANUP_S, FAILED, EXIT_PEER_LOST,
                                     redact(diagnosis.splitlines()[0][:300]))
    os._exit(EXIT_PEER_LOST)


@dataclass
class ResumeTiming:
    """Where a resumed process's start-up went (metrics.jsonl's "resume" record; figure 13 splits a membership
    change's recovery with it): its start to the checkpoint's read, then each part timed by ``lap``."""

    started_s: float | None  # from the process's start to the read (None where the OS does not say)
    laps: dict[str, float] = field(default_factory=dict)
    last: float = field(default_factory=time.perf_counter)

    def lap(self, name: str) -> None:
        """The time since the previous lap (or the start), as ``name``."""
        now = time.perf_counter()
        self.laps[name], self.last = now - self.last, now

    def values(self) -> dict[str, float]:
        return self.laps if self.started_s is None else {"started_s": self.started_s, **self.laps}


def write_config(output_dir: Path, shown_config: str) -> None:
    path = output_dir / "config.yaml"
    with writing(path):
        output_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(shown_config)


def _prepare_and_fit(config: Config, task: RunTask, runtime: Runtime, checkpoints: CheckpointManager,
                     watcher: PreemptionWatcher, log: logging.Logger, shown_config: str, tracking: Tracking,
                     progress: TrainJobProgress, endpoint: MetricsEndpoint) -> tuple[dict[str, float], Trainer]:
    checkpoints.prepare()
    # The checkpoint is read, and its fit to this run checked, before the data and model are built.
    timing = ResumeTiming(seconds_since_process_start())
    loaded = checkpoints.load(config.checkpoint.resume)
    timing.lap("read_s")
    if loaded is not None:
        for change in check_resume(loaded, config, task):
            log.info("resuming with a change: %s", change)
    setup = build_training(config, task, runtime,
                           None if loaded is None else checkpoint_layout(loaded.state.model))
    trainer = Trainer(config, runtime, setup, checkpoints, watcher, log, tracking, progress, endpoint)
    timing.lap("build_s")
    try:
        if loaded is not None:
            # Agreed: under --sync fsdp each rank reads its own shards, and may be the only one to fail.
            agreed(runtime, lambda: trainer.restore(loaded), CheckpointError)
            timing.lap("restore_s")
            trainer.record_resume(timing.values())
            endpoint.checkpoint_resumed(trainer.position, loaded.manifest.get("created_unix"))
            if config.checkpoint.init_from and runtime.is_main:
                log.info("--init-from is for a fresh start: this run resumes from %s instead", loaded.location)
        elif config.checkpoint.init_from:
            agreed(runtime, lambda: trainer.init_from(config.checkpoint.init_from), CheckpointError)
        # Once the run is known to go ahead: a refused resume leaves the last one's.
        agreed(runtime, lambda: write_config(Path(config.output.output_dir), shown_config) if runtime.is_main
               else None, OutputError)
        # After the restore: a resumed run continues its tracker runs (their ids are in the checkpoint).
        resumed_at = trainer.position.step if loaded is not None else None
        agreed(runtime, lambda: tracking.start(redacted(layout(config, task)), resumed_at), TrackerError)
        plan = Plan(setup.schedule.total_samples, config.train.epochs, config.train.max_steps)
        progress.watch(trainer.position, plan, resumed_at)
        return trainer.fit(), trainer
    finally:
        trainer.close()


def train(config: Config, task: RunTask, runtime: Runtime, on_commit: Callable[[Committed], None] | None = None,
          status_server: StatusServer | None = None, stop_requests: StopRequests | None = None
          ) -> dict[str, object]:
    """One training run in a joined group: returns (and rank 0 writes) the summary. ``status_server``: the
    TrainJob's, where rank 0 reports the progress (trainer.trainjob_progress)."""
    log = setup_logging(runtime.identity)
    started = time.perf_counter()
    output_dir = Path(config.output.output_dir)
    shown_config = redact(dump_yaml(config, task))  # logged now, written to config.yaml once the run goes ahead
    if runtime.is_main:
        log.info("config:\n%s", shown_config.rstrip())
    log.info("%s; device %s, backend %s, %d threads; task %s", runtime.identity.describe(), runtime.device,
             runtime.backend, torch.get_num_threads(), task.describe())
    old_driver = working_cuda_warning(driver_check()) if runtime.device.type == "cuda" else None
    if old_driver is not None:
        log.warning("%s", old_driver)

    watcher = PreemptionWatcher(config.checkpoint.grace_period_s, runtime, log, stop_requests)
    watcher.install()  # before the slow parts, so an early SIGTERM is not lost
    checkpoints = CheckpointManager(config.checkpoint, config.checkpoint_location, runtime, log, Monitor(*task.monitor))
    endpoint = MetricsEndpoint(config.output, runtime.identity)

    def committed(saved: Committed) -> None:
        # Rank 0 wrote it; its timing is that write's until the next save is launched, after this.
        endpoint.checkpoint_committed(saved.step, saved.created_unix,
                                      checkpoints.last_timing.write_s if runtime.is_main else None)
        if on_commit is not None:
            on_commit(saved)

    # Only where something listens: telling of a commit costs every rank a broadcast of its time
    # (CheckpointManager._settle), which a run without --metrics-port or a launcher's hook need not pay.
    if endpoint.enabled or on_commit is not None:
        checkpoints.on_commit = committed
    watcher.before_forced_exit = lambda: checkpoints.release_lease(STOPPED)
    if runtime.liveness is not None:
        runtime.liveness.watch_progress(config.dist.collective_timeout_s + PROGRESS_GRACE_S,
                                        lambda diagnosis: _exit_stuck(runtime, diagnosis, checkpoints))
    tracking = Tracking(config.tracking, output_dir, runtime.is_main, log)
    progress = TrainJobProgress(status_server if runtime.is_main else None, log, runtime.identity.restart_count)
    # Ends the tracker runs and the progress reports as the training ends: finished, preempted (within the grace
    # period) or failed. The metrics endpoint (--metrics-port) serves from before the slow parts to the end.
    with endpoint.serving(log), tracking.run(end_by=watcher.exit_deadline), \
            progress.run(end_by=watcher.exit_deadline):
        ending = FAILED
        try:
            result, trainer = _prepare_and_fit(config, task, runtime, checkpoints, watcher, log, shown_config,
                                               tracking, progress, endpoint)
            ending = FINISHED
        except Preempted:
            # This rank's own signal or request (a membership change, the launcher's end, its node drained);
            # stopped by another rank's, it exits as its launcher counts a failure (CheckpointManager.release_lease).
            ending = STOPPED if watcher.asked_here else FAILED
            raise
        except RuntimeError as error:
            if runtime.liveness is None or not TIMED_OUT.search(str(error)):
                raise
            diagnosis = runtime.liveness.diagnose(config.dist.collective_timeout_s)
            raise PeerLost(diagnosis + _timeout_advice(runtime)) from None
        finally:
            try:
                if tracking.enabled and config.tracking.tracker_checkpoints:
                    tracking.log_checkpoint(checkpoint_written(checkpoints, log))
            finally:
                # The folder's lease: released, or kept for the next attempt of a job its launcher restarts in
                # place (CheckpointManager.release_lease); a kill leaves it to expire. How this process ends goes
                # into it, for the next attempt's count of attempts without progress.
                checkpoints.close(ending, *_exit_of(sys.exc_info()[1]))
                watcher.uninstall()
        summary = _summary(task, result, runtime, trainer, time.perf_counter() - started)
        agreed(runtime, lambda: write_summary(output_dir, summary) if runtime.is_main else None, OutputError)
        tracking.log_summary(summary, (output_dir / "config.yaml", output_dir / "summary.json"))
    if runtime.is_main:
        print(final_line(summary), flush=True)
    return summary


def _exit_of(error: BaseException | None) -> tuple[int, str]:
    """The exit code an error in flight ends this process with (as ``run`` maps it), and its first line."""
    if error is None:
        return EXIT_OK, ""
    if isinstance(error, Preempted):
        return EXIT_PREEMPTED, first_line(error)
    if isinstance(error, UserError):
        return error.exit_code, redact(first_line(Exception(user_message(error)))[:300])
    said = redact(first_line(error)[:300])
    if isinstance(error, torch.distributed.DistError) or PEER_LOST.search(said):
        return EXIT_PEER_LOST, said
    return EXIT_FAILURE, f"{type(error).__name__}: {said}"


def _summary(task: RunTask, result: dict[str, float], runtime: Runtime, trainer: Trainer, wall_time_s: float
             ) -> dict[str, Any]:
    """summary.json: the final evaluation, where training stands and how fast it went."""
    samples_per_s = (trainer.position.samples_seen - trainer.samples_at_start) / wall_time_s
    return {
        "task": task.name,
        "test_metrics": result,
        **{f"test_{name}": value for name, value in result.items()},
        "world_size": runtime.identity.world_size,
        "ranks": gather_to_main({**runtime.identity.to_dict(), **peak_memory(runtime.device)}, runtime) or [],
        "global_step": trainer.position.step,
        "epochs_completed": trainer.position.epoch,
        "resumed_from": None if trainer.resumed_from is None else redact(trainer.resumed_from),
        "wall_time_s": round(wall_time_s, 3),
        "train_samples_per_s": round(samples_per_s, 1),
        # Over the same wall time: FLOPs per sample, FLOP/s per device and MFU, where known (trainer.throughput).
        **trainer.setup.throughput.summary(samples_per_s),
    }


def checkpoint_written(checkpoints: CheckpointManager, log: logging.Logger,
                       within_s: float = CHECKPOINT_LOOKUP_S) -> CheckpointFiles | None:
    """The checkpoint this run committed last, for --tracker-checkpoints (not the newest folder by name: after
    --resume PATH that may be another branch's); None when there is none, the storage stalled, or its files
    cannot be listed within ``within_s`` (the upload is a courtesy: it never fails, nor holds, the run's end)."""
    name = checkpoints.last_committed
    if name is None or checkpoints.stalled:
        return None
    storage = checkpoints.storage
    found: list[CheckpointFiles] = []

    def look() -> None:
        try:
            found.append(CheckpointFiles(name, tuple(storage.files(name)),
                                         lambda filename: storage.read(name, filename)))
        except Exception as error:  # noqa: BLE001 - any backend's error: the courtesy is skipped, with a word
            log.warning("listing checkpoint %s failed (%s); the trackers get no checkpoint", storage.describe(name),
                        redact(described(error)))

    looking = threading.Thread(target=look, name="checkpoint-lookup", daemon=True)
    looking.start()
    looking.join(within_s)
    if looking.is_alive():
        log.warning("checkpoint %s not sent to the trackers: listing its files took more than %gs",
                    storage.describe(name), within_s)
    return found[0] if found else None

