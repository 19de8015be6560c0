"""A Ray run from the driver's side: its input checked before anything starts, the cluster joined, the run's folder
held and checked on every node, then Ray Train's fit, and its outcome as an exit code."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer.checkpoint import open_storage
from trainer.cli import parse_config
from trainer.config import Config
from trainer.errors import EXIT_OK, EXIT_PEER_LOST, EXIT_USAGE, UserError, first_line
from trainer.on_ray import cluster, paths, ray_internals, shared_storage
from trainer.on_ray.driver_lock import driving
from trainer.on_ray.pointers import pointer_target
from trainer.on_ray.settings import RayLaunchError, RayRun
from trainer.on_ray.worker import has_committed, train_in_worker
from trainer.redact import redact

__all__ = ["run_on_ray"]

TRAINER_EXIT = re.compile(r"the trainer exited with (\d+)")


def run_on_ray(task: str | type | None = None, argv: Sequence[str] = (), ray_run: RayRun | None = None,
               **settings: Any) -> int:
    """Train ``task`` (as trainer.run takes it) with Ray Train; ``argv`` are the trainer's flags, ``settings`` its
    config values. Returns the exit code: 0, EXIT_USAGE for input to fix, EXIT_PEER_LOST when Ray gave up."""
    ray_run = ray_run or RayRun()
    # Read before joining the cluster: in a job's --working-dir, ray.init may unpack that folder anew, which leaves
    # this process in a deleted one (seen here: os.getcwd() then fails).
    driver_folder = os.getcwd()
    try:
        ray_run.check()
        # The run's folder made absolute now, for the same reason (RayRun.folder would read the folder again).
        relative_storage = not os.path.isabs(os.path.expanduser(ray_run.storage_path))
        ray_run = dataclasses.replace(ray_run, storage_path=os.path.join(
            driver_folder, os.path.expanduser(ray_run.storage_path)))
        trainer_argv, config = _trainer_arguments(task, argv, ray_run, settings)
        with driving(Path(ray_run.folder)):
            _check_resume(config, ray_run)
            return _fit(task, trainer_argv, config, ray_run, settings, driver_folder, relative_storage)
    except UserError as error:
        print(f"error: {redact(str(error))}", file=sys.stderr, flush=True)
        return error.exit_code


def _trainer_arguments(task: str | type | None, argv: Sequence[str], ray_run: RayRun,
                       settings: Mapping[str, Any]) -> tuple[list[str], Config]:
    """The trainer's flags with the run's folder as --output-dir (the user's own flags come after it, and win),
    checked on the driver: a bad flag is one line here, not a failure in every worker and every restart."""
    arguments = ["--output-dir", ray_run.folder, *argv]
    config, _ = parse_config(arguments, task=task, settings=settings, prog="ddp-train-ray")
    _check_every_size(config, ray_run)
    return arguments, config


def _check_every_size(config: Config, ray_run: RayRun) -> None:
    """--global-batch-size must divide at every worker count Ray may give an elastic run: found here, not by the
    workers when Ray resizes the run to a count it does not divide (which would fail every attempt at that size)."""
    accum, global_batch = config.optim.grad_accum_steps, config.train.global_batch_size
    sizes = range(ray_run.num_workers[0], ray_run.num_workers[1] + 1)
    bad = [size for size in sizes if not config.train.divides(size, accum)]
    if bad:
        step = math.lcm(*sizes) * accum
        advice = f"give a multiple of {step}" if step < 10**12 else "narrow --ray-workers"
        shown = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
        raise RayLaunchError(f"--global-batch-size {global_batch} does not divide into {shown} worker(s) x {accum} "
                             f"micro-batch(es), and Ray may run it at any of {ray_run.workers_text} workers; "
                             f"{advice}")


def _check_resume(config: Config, ray_run: RayRun) -> None:
    """A run that has checkpoints goes on from them (that is what its name is for); a --resume that says otherwise
    is refused rather than overridden, since the workers resume a run with checkpoints from its newest."""
    wanted = config.checkpoint.resume
    if wanted == "latest":
        return
    try:
        found = has_committed(config.checkpoint_location)
    except Exception as error:  # noqa: BLE001 - any backend's: the driver may hold no credentials for the store
        print(redact(f"warning: cannot see whether run {ray_run.name} has checkpoints in "
                     f"{config.checkpoint_location} ({first_line(error)[:200]}); where it has, its workers resume "
                     f"from them whatever --resume says"), file=sys.stderr, flush=True)
        return
    if found:
        raise RayLaunchError(redact(f"--resume {wanted}: run {ray_run.name} already has checkpoints in "
                                    f"{config.checkpoint_location}, and a run goes on from its own; for a new run "
                                    f"give a new --ray-run-name (or none: each run gets its own), or drop --resume "
                                    f"to go on"))


def _fit(task: str | type | None, argv: list[str], config: Config, ray_run: RayRun, settings: Mapping[str, Any],
         driver_folder: str, relative_storage: bool) -> int:
    ray = cluster.import_ray()
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    wrong_version = ray_internals.check_ray_version(ray.__version__)
    if wrong_version:
        raise RayLaunchError(wrong_version)
    if not ray_internals.train_v2_enabled():
        raise RayLaunchError("RAY_TRAIN_V2_ENABLED=0: ddp-train-ray runs on Ray Train V2 (its reports, its elastic "
                             "runs); unset it")
    # A Python caller may have joined the cluster its own way (ray.init with a runtime_env, say): that connection
    # is used, and left open.
    joined_here = not ray.is_initialized()
    if joined_here:
        cluster.connect(ray, ray_run)
    try:
        cluster.check_capacity(ray, ray_run)
        job_working_dir = ray_internals.runtime_working_dir(ray) is not None
        if job_working_dir and relative_storage:
            raise RayLaunchError(f"--ray-storage-path {Path(ray_run.storage_path).relative_to(driver_folder)}: a "
                                 f"relative path is inside the job's --working-dir, which each node unpacks for "
                                 f"itself (and Ray may clear); give a folder every node mounts, as an absolute path")
        # Strings alone from here: this process's own folder may be gone (run_on_ray says when).
        argv = paths.as_workers_read_them(argv, driver_folder, job_working_dir)
        location = paths.checkpoint_location(config.checkpoint_location, driver_folder, job_working_dir)
        local = location.removeprefix("file://")
        shared = [ray_run.folder, *([local] if "://" not in local else [])]
        print(f"Ray run {ray_run.name} in {ray_run.folder} (to go on with it after a stop, start it again with "
              f"--ray-run-name {ray_run.name})", flush=True)
        with shared_storage.markers(shared) as markers:
            shared_storage.check_every_node(ray, _worker_nodes(ray, ray_run), markers)
            low, high = ray_run.num_workers
            scaling = ScalingConfig(num_workers=low if low == high else (low, high), use_gpu=ray_run.use_gpu,
                                    resources_per_worker={"CPU": ray_run.cpus_per_worker,
                                                          **({"GPU": 1} if ray_run.use_gpu else {})},
                                    elastic_resize_monitor_interval_s=ray_run.resize_check_s)
            # Ray's checkpoints are pointers to the trainer's (trainer/on_ray/pointers.py): it keeps the newest.
            run_config = RunConfig(name=ray_run.name, storage_path=str(Path(ray_run.folder).parent),
                                   failure_config=FailureConfig(max_failures=ray_run.max_failures),
                                   checkpoint_config=CheckpointConfig(num_to_keep=1))
            spec = {"task": task, "argv": list(argv), "settings": dict(settings), "run": ray_run.folder,
                    "checkpoints": location, "markers": markers, "driver_folder": driver_folder,
                    "job_working_dir": job_working_dir}
            with ray_internals.workers_keep_their_folder():
                trainer = TorchTrainer(train_in_worker, train_loop_config=spec,
                                       torch_config=ray_internals.trainer_process_group(),
                                       scaling_config=scaling, run_config=run_config)
                try:
                    result = trainer.fit()
                except Exception as error:  # noqa: BLE001 - Ray's TrainingFailedError and its kin: one line each
                    if not type(error).__module__.startswith("ray."):
                        raise
                    return _gave_up(error, ray_run)
        print(f"Ray run {ray_run.folder}: {_newest(location, result)}", flush=True)
        return EXIT_OK
    finally:
        if joined_here:
            ray.shutdown()


def _worker_nodes(ray: Any, ray_run: RayRun) -> list[dict[str, Any]]:
    """The live nodes a worker of this run could be placed on: those the shared folders matter to."""
    def fits(resources: Mapping[str, float]) -> bool:
        return (resources.get("CPU", 0) >= ray_run.cpus_per_worker
                and (not ray_run.use_gpu or resources.get("GPU", 0) >= 1))
    return [node for node in cluster.alive_nodes(ray) if fits(node.get("Resources", {}))]


def _gave_up(error: Exception, ray_run: RayRun) -> int:
    """Ray's last failure as the exit code: input to fix where every worker's trainer said so, or where a node does
    not see the run's folder (Ray retries any failure), else retryable from the checkpoints."""
    failures = getattr(error, "worker_failures", {}) or {}
    texts = [str(failure) for failure in failures.values()]
    not_shared = [text for text in texts if shared_storage.NotShared.__name__ in text]
    if not_shared:
        line = next((part for part in not_shared[0].splitlines() if "does not see" in part), not_shared[0])
        print(f"error: Ray Train gave up on run {ray_run.folder}: {redact(line.strip()[:600])}", file=sys.stderr,
              flush=True)
        return EXIT_USAGE
    codes = [TRAINER_EXIT.findall(text) for text in texts]
    if codes and all(found and int(found[0]) == EXIT_USAGE for found in codes):
        print(f"error: Ray Train gave up on run {ray_run.folder}: the trainer refused its input on every worker "
              f"(exit {EXIT_USAGE}; the workers' log above says why)", file=sys.stderr, flush=True)
        return EXIT_USAGE
    print(f"error: Ray Train gave up on run {ray_run.folder} ({redact(first_line(error)[:400])}); its checkpoints "
          f"are intact: start it again with --ray-run-name {ray_run.name} and the same --ray-storage-path to resume",
          file=sys.stderr, flush=True)
    return EXIT_PEER_LOST


def _newest(location: str, result: Any) -> str:
    """The run's newest checkpoint, and Ray's last report where it names an older one (a worker died between a
    commit and its report, or the last start had nothing left to train). Only what Ray reported where the driver
    cannot list the checkpoints (they are the workers' to reach: a bucket whose credentials only they hold)."""
    reported = pointer_target(result.checkpoint.path) if result.checkpoint is not None else None
    try:
        storage = open_storage(location)
        names = storage.list_checkpoints()
        newest = storage.describe(names[0]) if names else None
    except Exception:  # noqa: BLE001 - any backend's error: the training is done, the line only informs
        newest = None
    if newest is None:
        return redact(f"Ray's last report named checkpoint {reported}" if reported else
                      f"no checkpoint that the driver can see in {location}")
    return redact(f"newest checkpoint {newest}" + (f" (Ray's last report named {reported})"
                                                    if reported not in (None, newest) else ""))
