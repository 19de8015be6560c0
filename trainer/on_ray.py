"""Ray Train as a launcher: ``ddp-train-ray`` and ``run_on_ray``, the trainer's run in every worker of a Ray Train
``TorchTrainer``.

Each Ray worker runs ``trainer.run``, the same code path as under any other launcher, with the trainer's own
process group: Ray places the workers and names worker 0's address and a free port on it (MASTER_ADDR,
MASTER_PORT), but does not join a group itself (``TrainerProcessGroup``). The trainer's group is the one it makes
under every launcher: its backend choice, its --collective-timeout-s, the NCCL and flight-recorder settings that
must be in place before the group exists, and its liveness store (heartbeats, stall diagnosis).

The run's folder, ``STORAGE_PATH/NAME`` (Ray's ``RunConfig``), is the trainer's --output-dir by default. Each
checkpoint is reported to Ray as it commits (``ray.train.report``), as a Checkpoint that points at it, not a copy of
it (``write_pointer``): Ray's newest checkpoint is the trainer's newest committed one, or one behind it when a worker
died between the commit and the report. A restarted worker group (after a failure, a resize of an elastic run, or
the driver started again with the same run) resumes from the newest committed checkpoint with --resume latest, at
the exact sample where it stopped, for any number of workers (--global-batch-size keeps the optimisation the same
across sizes). The checkpoints may be anywhere every worker reaches (--checkpoint-dir: a shared folder, s3://).

Ray Train runs the training function in a thread of each worker: stop signals go to Ray, not to the trainer
(trainer.preemption), and a stopped or resized worker group loses the steps since the last checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import functools
import json
import math
import os
import re
import socket
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.api import run
from trainer.checkpoint import Committed, open_storage
from trainer.checkpoint.storage import MANIFEST
from trainer.cli import parse_config
from trainer.config import Config
from trainer.errors import EXIT_OK, EXIT_PEER_LOST, EXIT_USAGE, UserError, first_line
from trainer.launchers.ray_train import RAY_RUN_VARIABLE
from trainer.redact import redact

__all__ = ["RayRun", "main", "run_on_ray"]

# How long the cluster's address may take to accept a connection before the run is refused.
CONNECT_TIMEOUT_S = 10.0
# Ray's checkpoints, in the run's folder: each a folder holding the trainer checkpoint's location (write_pointer).
POINTERS, POINTER_FILE = "ray-checkpoints", "checkpoint.json"
DRIVER_LOCK = ".driver.lock"  # in the run's folder: held by its one driver (driving)
TRAINER_EXIT = re.compile(r"the trainer exited with (\d+)")
RAY_MISSING = "Ray Train is not installed: pip install 'ddp-deploy[ray]' (or ray[train] itself)"


class RayLaunchError(UserError):
    """A Ray run that cannot start: the cluster, its capacity, or the run's folder."""


@dataclass(frozen=True)
class RayRun:
    """How Ray runs the trainer: the workers (ScalingConfig), the run (RunConfig) and the cluster."""

    num_workers: tuple[int, int] = (1, 1)  # (min, max): equal for a fixed size; otherwise Ray resizes within it
    name: str = "ddp-train"  # RunConfig(name): the run, across Ray's restarts and a driver started again
    storage_path: str = "~/ray_results"  # RunConfig(storage_path): a folder every worker reaches
    address: str | None = None  # ray.init(address): None joins a running local cluster or starts one
    use_gpu: bool = False  # one GPU per worker (NCCL)
    cpus_per_worker: float = 1.0
    max_failures: int = 3  # FailureConfig(max_failures): worker-group restarts after failures
    # An elastic run: how often Ray looks for room to grow (ScalingConfig's elastic_resize_monitor_interval_s).
    resize_check_s: float = 60.0
    cluster_autoscales: bool = False  # workers that do not fit now may fit later: do not refuse them at the start

    @property
    def folder(self) -> str:
        """The run's folder: Ray's RunConfig storage path and name, the trainer's --output-dir."""
        return str(Path(os.path.expanduser(self.storage_path)).absolute() / self.name)


def run_on_ray(task: str | type | None = None, argv: Sequence[str] = (), ray_run: RayRun | None = None,
               **settings: Any) -> int:
    """Train ``task`` (as trainer.run takes it) with Ray Train; ``argv`` are the trainer's flags, ``settings`` its
    config values. Returns the exit code: 0, EXIT_USAGE for input to fix, EXIT_PEER_LOST when Ray gave up."""
    ray_run = ray_run or RayRun()
    try:
        _check_run(ray_run)
        trainer_argv, location = _trainer_arguments(task, argv, ray_run, settings)
        with driving(Path(ray_run.folder)):
            return _fit(task, trainer_argv, location, ray_run, settings)
    except UserError as error:
        print(f"error: {redact(str(error))}", file=sys.stderr, flush=True)
        return error.exit_code


def _check_run(ray_run: RayRun) -> None:
    """What the command line's types check, for the Python form too."""
    low, high = ray_run.num_workers
    problems = [(not 1 <= low <= high, f"num_workers {ray_run.num_workers}: need 1 <= MIN <= MAX"),
                (not (math.isfinite(ray_run.cpus_per_worker) and ray_run.cpus_per_worker > 0),
                 f"cpus_per_worker {ray_run.cpus_per_worker}: need a number above 0"),
                (not (math.isfinite(ray_run.resize_check_s) and ray_run.resize_check_s > 0),
                 f"resize_check_s {ray_run.resize_check_s}: need a number above 0"),
                (ray_run.max_failures < -1, f"max_failures {ray_run.max_failures}: need -1 (no limit) or more")]
    for wrong, message in problems:
        if wrong:
            raise RayLaunchError(f"RayRun {message}")


def _trainer_arguments(task: str | type | None, argv: Sequence[str], ray_run: RayRun,
                       settings: Mapping[str, Any]) -> tuple[list[str], str]:
    """The trainer's flags with the run's folder as --output-dir (the user's own flags come after it, and win),
    checked on the driver: a bad flag is one line here, not a failure in every worker and every restart. With
    where the checkpoints go."""
    if "://" in ray_run.storage_path:
        raise RayLaunchError(f"--ray-storage-path {ray_run.storage_path}: Ray's run folder must be a folder every "
                             f"worker mounts (NFS, a shared volume) under ddp-train-ray; the checkpoints themselves "
                             f"may go to an object store (--checkpoint-dir s3://...)")
    if ray_run.name in ("", ".", "..") or "/" in ray_run.name or os.sep in ray_run.name:
        raise RayLaunchError(f"--ray-run-name {ray_run.name!r}: a run's name is one folder name (no '/', not '.' or "
                             f"'..'), its folder STORAGE_PATH/NAME; put any hierarchy in --ray-storage-path")
    arguments = ["--output-dir", ray_run.folder, *argv]
    config, _ = parse_config(arguments, task=task, settings=settings, prog="ddp-train-ray")
    _check_every_size(config, ray_run.num_workers)
    return arguments, config.checkpoint_location


def _check_every_size(config: Config, workers: tuple[int, int]) -> None:
    """--global-batch-size must divide at every worker count Ray may give an elastic run: found here, not by the
    workers when Ray resizes the run to a count it does not divide (which would fail every attempt at that size)."""
    accum, global_batch = config.optim.grad_accum_steps, config.train.global_batch_size
    sizes = range(workers[0], workers[1] + 1)
    bad = [size for size in sizes if not config.train.divides(size, accum)]
    if bad:
        step = math.lcm(*sizes) * accum
        advice = f"give a multiple of {step}" if step < 10**12 else "narrow --ray-workers"
        shown = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
        raise RayLaunchError(f"--global-batch-size {global_batch} does not divide into {shown} worker(s) x {accum} "
                             f"micro-batch(es), and Ray may run it at any of {_workers_text(workers)} workers; "
                             f"{advice}")


@contextlib.contextmanager
def driving(folder: Path) -> Iterator[None]:
    """This driver's hold on its run, for as long as it runs: a second driver of the same run would be the same
    job to the checkpoint folder's lease (that is how a driver started again after a crash resumes at once), and
    the two would take the checkpoints from each other. A POSIX lock on RUN/.driver.lock, which the system releases
    when the driver dies, however it dies (a shared folder's NFS locks too)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = (folder / DRIVER_LOCK).open("a+")
    except OSError as error:
        raise RayLaunchError(f"cannot write the Ray run's folder {folder} ({error.strerror or error}); choose another "
                             f"--ray-storage-path") from None
    with handle:
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            # Locking fails here (ENOLCK, ...); a nolock mount locks locally and never gets here.
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                print(f"warning: cannot lock {folder / DRIVER_LOCK} ({error.strerror}): a second driver of this run "
                      f"would not be refused", file=sys.stderr, flush=True)
                yield
                return
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise RayLaunchError(f"run {folder} already has a driver ({holder}): two drivers of one run would take "
                                 f"its checkpoints from each other; stop that one, or choose another --ray-run-name"
                                 ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"ddp-train-ray pid {os.getpid()} on {socket.gethostname()}")
        handle.flush()
        yield


def _import_ray() -> Any:
    try:
        import ray
        import ray.train  # noqa: F401 - the Train library, an extra of ray
        import ray.train.torch  # noqa: F401
    except ImportError:
        raise RayLaunchError(RAY_MISSING) from None
    return ray


def _fit(task: str | type | None, argv: list[str], location: str, ray_run: RayRun, settings: Mapping[str, Any]
         ) -> int:
    ray = _import_ray()
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.constants import is_v2_enabled

    if not is_v2_enabled():
        raise RayLaunchError("RAY_TRAIN_V2_ENABLED=0: ddp-train-ray runs on Ray Train V2 (its reports, its elastic "
                             "runs); unset it")

    # A Python caller may have joined the cluster its own way (ray.init with a runtime_env, say): that connection
    # is used, and left open.
    joined_here = not ray.is_initialized()
    if joined_here:
        _connect(ray, ray_run)
    try:
        _check_capacity(ray, ray_run)
        low, high = ray_run.num_workers
        scaling = ScalingConfig(num_workers=low if low == high else (low, high), use_gpu=ray_run.use_gpu,
                                resources_per_worker={"CPU": ray_run.cpus_per_worker,
                                                      **({"GPU": 1} if ray_run.use_gpu else {})},
                                elastic_resize_monitor_interval_s=ray_run.resize_check_s)
        # Ray's checkpoints are pointers to the trainer's (write_pointer): it keeps the newest.
        run_config = RunConfig(name=ray_run.name, storage_path=str(Path(ray_run.folder).parent),
                               failure_config=FailureConfig(max_failures=ray_run.max_failures),
                               checkpoint_config=CheckpointConfig(num_to_keep=1))
        spec = {"task": task, "argv": list(argv), "settings": dict(settings), "run": ray_run.folder,
                "checkpoints": location}
        trainer = TorchTrainer(_train_in_worker, train_loop_config=spec, torch_config=trainer_process_group(),
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


def _gave_up(error: Exception, ray_run: RayRun) -> int:
    """Ray's last failure as the exit code: input to fix where every worker's trainer said so (Ray retries any
    failure), else retryable from the checkpoints."""
    failures = getattr(error, "worker_failures", {}) or {}
    codes = [TRAINER_EXIT.findall(str(failure)) for failure in failures.values()]
    if codes and all(found and int(found[0]) == EXIT_USAGE for found in codes):
        print(f"error: Ray Train gave up on run {ray_run.folder}: the trainer refused its input on every worker "
              f"(exit {EXIT_USAGE}; the workers' log above says why)", file=sys.stderr, flush=True)
        return EXIT_USAGE
    print(f"error: Ray Train gave up on run {ray_run.folder} ({redact(first_line(error)[:400])}); its checkpoints "
          f"are intact: start it again with the same --ray-run-name and --ray-storage-path to resume",
          file=sys.stderr, flush=True)
    return EXIT_PEER_LOST


def _newest(location: str, result: Any) -> str:
    """The run's newest checkpoint, and Ray's last report where it names an older one (a worker died between a
    commit and its report, or the last start had nothing left to train). Only what Ray reported where the driver
    cannot list the checkpoints (they are the workers' to reach: a bucket whose credentials only they hold)."""
    reported = _pointer_target(result.checkpoint.path) if result.checkpoint is not None else None
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


def _connect(ray: Any, ray_run: RayRun) -> None:
    address = ray_run.address or os.environ.get("RAY_ADDRESS", "")
    _check_reachable(address)
    try:
        ray.init(address=ray_run.address)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise _unreachable(address or "the local machine", first_line(error)[:300]) from None


def _unreachable(where: str, why: str) -> RayLaunchError:
    return RayLaunchError(f"cannot reach the Ray cluster at {where} ({why}); start one with `ray start --head`, or "
                          f"pass its GCS address as --ray-address HOST:PORT")


def _check_reachable(address: str) -> None:
    """A cluster address HOST:PORT (or ray://HOST:PORT) that does not answer: one line in seconds, where ray.init
    would retry for minutes."""
    bare = address.removeprefix("ray://")
    host, _, port = bare.rpartition(":")
    if "://" in bare or not host or not port.isdigit():
        return  # "auto", "local", none, or a dashboard's http:// address: ray.init finds the cluster itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise _unreachable(address, str(error.strerror or error)) from None


def _check_capacity(ray: Any, ray_run: RayRun) -> None:
    """Refuse at once a run the cluster cannot place (Ray itself would wait for room forever): how many workers
    fit on the live nodes, each on one node with its CPUs (and GPU)."""
    if ray_run.cluster_autoscales:
        return
    fits = 0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        by_cpu = int(resources.get("CPU", 0) // ray_run.cpus_per_worker) if ray_run.cpus_per_worker else 10**6
        fits += min(by_cpu, int(resources.get("GPU", 0))) if ray_run.use_gpu else by_cpu
    low = ray_run.num_workers[0]
    if fits < low:
        need = f"{ray_run.cpus_per_worker:g} CPU" + (" and 1 GPU" if ray_run.use_gpu else "")
        raise RayLaunchError(f"--ray-workers {_workers_text(ray_run.num_workers)}: the Ray cluster has room for "
                             f"{fits} worker(s) of {need} each; add nodes, lower --ray-workers or "
                             f"--ray-cpus-per-worker, or pass --ray-cluster-autoscales if its autoscaler adds nodes")


def _workers_text(workers: tuple[int, int]) -> str:
    return str(workers[0]) if workers[0] == workers[1] else f"{workers[0]}:{workers[1]}"


def _train_in_worker(spec: dict[str, Any]) -> None:
    """Ray's training function, in each worker: the trainer's run, its checkpoints reported to Ray as they
    commit. A non-zero exit is a failure Ray restarts the worker group for (FailureConfig)."""
    os.environ[RAY_RUN_VARIABLE] = spec["run"]
    argv = [*spec["argv"], *_resume_where_the_run_left_off(spec["checkpoints"])]
    code = run(spec["task"], argv, on_commit=functools.partial(report_to_ray, spec["run"]), **spec["settings"])
    if code != EXIT_OK:
        raise RuntimeError(f"the trainer exited with {code} on rank {os.environ.get('RANK', '?')}"
                           + (" (input to fix; see its log)" if code == EXIT_USAGE else ""))


def _resume_where_the_run_left_off(location: str) -> list[str]:
    """The flags a worker group adds once the run has checkpoints of its own (Ray restarted the group, or a driver
    started the run again): --resume latest, whatever the first start was given (--resume none or a path again
    would retrain from the start, or from a checkpoint pruned since). Found in the checkpoint folder, not asked of
    Ray: a worker that dies moments after a report takes it with it before Ray's controller collects it, and Ray
    then knows of no checkpoint (seen here: a group killed at step 4 had reported step 2, and its restart got none
    from ray.train.get_checkpoint)."""
    import ray.train

    if not _has_committed(location):
        return []
    if ray.train.get_context().get_world_rank() == 0:
        known = ray.train.get_checkpoint()
        told = f"Ray's last report named {_pointer_target(known.path)}" if known else "Ray knows of none"
        print(redact(f"the run has checkpoints in {location} ({told}): the trainer resumes from its newest committed "
                     f"one (--resume latest)"), flush=True)
    return ["--resume", "latest"]


def _has_committed(location: str) -> bool:
    """Whether the checkpoint folder holds a committed checkpoint (its manifest written): a save that never
    finished does not count, and the trainer removes it."""
    storage = open_storage(location)
    return any(MANIFEST in storage.files(name) for name in storage.list_checkpoints())


def _pointer_target(pointer: str) -> str:
    """pointed_at for a message: a pointer that cannot be read is named as such, never an error."""
    try:
        return pointed_at(pointer)
    except (OSError, ValueError, KeyError, TypeError):
        return f"(unreadable: {pointer})"


def report_to_ray(run_folder: str, committed: Committed) -> None:
    """on_commit under Ray: a barrier of every worker (ray.train.report), rank 0 reporting a pointer to the
    checkpoint (``pointer``)."""
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    checkpoint = None
    if committed.location is not None:
        checkpoint = Checkpoint(str(write_pointer(Path(run_folder), committed.location, committed.step)))
    metrics = {"step": committed.step, "epoch": committed.epoch,
               **{name: float(value) for name, value in committed.metrics.items()}}
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)


def write_pointer(run_folder: Path, location: str, step: int) -> Path:
    """Ray's checkpoint for the trainer's checkpoint at ``location``: a folder in the run holding only where that
    is (POINTER_FILE), Ray's own to delete (it keeps the newest). Not the trainer's folder itself: the trainer
    prunes its checkpoints (--keep-last), and Ray refuses to start a run again whose list names a folder that is
    gone ("a reference to a checkpoint that does not exist anymore")."""
    # A name of its own each time: two reports may name one checkpoint (an epoch-end save at the step of a
    # --checkpoint-every one replaces it), and Ray deletes the older report's folder as it registers the newer.
    pointer = run_folder / POINTERS / f"{Path(location).name}.{uuid.uuid4().hex[:8]}"
    pointer.mkdir(parents=True, exist_ok=True)
    (pointer / POINTER_FILE).write_text(json.dumps({"checkpoint": location, "step": step}))
    return pointer


def pointed_at(pointer: str | Path) -> str:
    """The trainer's checkpoint a pointer of Ray's names."""
    return str(json.loads((Path(pointer) / POINTER_FILE).read_text())["checkpoint"])


def trainer_process_group() -> Any:
    """Ray's TorchConfig, less its process group: the workers learn worker 0's address and a free port there,
    and the trainer joins its own group (the module's docstring says why)."""
    # Ray's own pieces (private, and so pinned in the dev extra): worker 0's address and a free port, and the
    # variables its TorchConfig sets.
    from ray.train._internal.utils import get_address_and_port
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _set_torch_distributed_env_vars, _TorchBackend

    class AddressOnly(_TorchBackend):  # type: ignore[misc]
        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            address, port = worker_group.execute_single(0, get_address_and_port)
            worker_group.execute(_name_master, address=address, port=port)
            worker_group.execute(_set_torch_distributed_env_vars)

        def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
            pass  # the trainer destroyed its group as its run ended

    class TrainerProcessGroup(TorchConfig):  # type: ignore[misc]
        @property
        def backend_cls(self) -> type:
            return AddressOnly

    return TrainerProcessGroup()


def _name_master(address: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = address
    os.environ["MASTER_PORT"] = str(port)


# -- command line ------------------------------------------------------------------------------------------------
# Every option carries --ray-: ddp-train's own flags (--num-workers, --run-name, ...) pass through to the trainer.
def _workers(text: str) -> tuple[int, int]:
    low_text, colon, high_text = text.partition(":")
    try:
        low, high = int(low_text), int(high_text if colon else low_text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return low, high


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: need a number above 0")
    return value


def ray_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddp-train-ray", allow_abbrev=False, add_help=False,
        description="Train with Ray Train: these options, then any of ddp-train's (ddp-train --help)")
    parser.add_argument("--ray-workers", type=_workers, default=(1, 1), metavar="N|MIN:MAX",
                        help="Ray workers (one rank each); MIN:MAX lets Ray resize the run within it")
    parser.add_argument("--ray-run-name", default="ddp-train",
                        help="the Ray run's name (a plain name): the same name resumes it")
    parser.add_argument("--ray-storage-path", default="~/ray_results",
                        help="a folder every worker reaches; the run's folder is STORAGE_PATH/RUN_NAME")
    parser.add_argument("--ray-address", default=None, help="the cluster's GCS address (default: RAY_ADDRESS, or a "
                                                            "local cluster)")
    parser.add_argument("--ray-gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--ray-cpus-per-worker", type=_positive, default=1.0)
    parser.add_argument("--ray-max-failures", type=int, default=3,
                        help="worker-group restarts after failures (-1: no limit)")
    parser.add_argument("--ray-resize-check-s", type=_positive, default=60.0,
                        help="elastic runs: how often Ray looks for room to grow")
    parser.add_argument("--ray-cluster-autoscales", action="store_true",
                        help="do not refuse workers the cluster cannot place now (its autoscaler adds nodes)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = ray_parser()
    args, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        return EXIT_OK
    ray_run = RayRun(num_workers=args.ray_workers, name=args.ray_run_name, storage_path=args.ray_storage_path,
                     address=args.ray_address, use_gpu=args.ray_gpu, cpus_per_worker=args.ray_cpus_per_worker,
                     max_failures=args.ray_max_failures, resize_check_s=args.ray_resize_check_s,
                     cluster_autoscales=args.ray_cluster_autoscales)
    return run_on_ray(None, rest, ray_run)


if __name__ == "__main__":
    sys.exit(main())
