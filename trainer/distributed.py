"""How this process joins the group: wait for the master, pick device and backend, init, tear down."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from trainer import cuda_driver
from trainer.config import DistConfig
from trainer.cores import usable_cores
from trainer.errors import DeviceError, RendezvousError, UserError, first_line
from trainer.launchers import DistIdentity
from trainer.liveness import PROGRESS_GRACE_S, Liveness
from trainer.peer_watch import PeerWatch

__all__ = ["Runtime", "StopVote", "agree", "agreed", "any_rank", "broadcast_from_main", "choose_backend",
           "choose_device", "gather_to_main", "largest", "process_group"]

T = TypeVar("T")


@dataclass(frozen=True)
class Runtime:
    """The joined group as the rest of the trainer sees it."""

    identity: DistIdentity
    device: torch.device
    backend: str
    liveness: Liveness | None = None  # heartbeats, where there are peers to watch
    # The ranks' control traffic (agreements, stop votes, Python objects): gloo over CPU tensors, whatever
    # the training backend, so that none of it makes the CPU wait for a GPU or queues behind gradients.
    control: dist.ProcessGroup | None = None

    def busy(self, doing: str) -> AbstractContextManager[None]:
        """Name this rank's work in its heartbeat, for the ranks that wait for it (trainer.liveness)."""
        return self.liveness.busy(doing) if self.liveness is not None else nullcontext()

    def wait_for_all(self, what: str) -> None:
        """The end of long work on some ranks (trainer.liveness): waits for peers that are alive, however long."""
        if self.liveness is not None:
            self.liveness.wait_for_all(what)

    @property
    def is_main(self) -> bool:
        return self.identity.is_main


def choose_device(config: DistConfig, identity: DistIdentity, cuda_count: int | None = None,
                  node: cuda_driver.NodeSources | None = None) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present (never the global rank: it exceeds a node's GPUs), else cpu.

    Where CUDA counts no device, a driver too old for this torch's CUDA is named (trainer.cuda_driver)."""
    node = node or cuda_driver.THIS_NODE
    available = node.cuda_devices() if cuda_count is None else cuda_count
    if config.device == "cpu":
        return torch.device("cpu")
    if available == 0:
        check = cuda_driver.driver_check(node)
        refusal = cuda_driver.no_device_refusal(config.device, check, node)
        if refusal is not None:
            raise DeviceError(refusal)
        if config.device == "auto":
            return torch.device("cpu")
        raise DeviceError(f"--device cuda but this machine has no CUDA device: {check.describe()}; use --device "
                          f"cpu or auto")
    if identity.may_hide_other_gpus and available == 1 < identity.local_world_size:
        # srun --gpus-per-task=1 (or --gpu-bind) shows each task its own GPU only, as device 0.
        return torch.device("cuda", 0)
    if identity.local_rank >= available:
        raise DeviceError(
            f"local rank {identity.local_rank} needs GPU {identity.local_rank} but this node has {available} "
            f"GPU(s); start at most {available} processes per node (--nproc-per-node {available})"
        )
    return torch.device("cuda", identity.local_rank)


def choose_backend(config: DistConfig, device: torch.device) -> str:
    backend = config.backend
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise DeviceError("--backend nccl needs CUDA devices; use --backend gloo (or auto) on CPU")
    return backend


def threads_per_rank(config: DistConfig, identity: DistIdentity, environ: dict[str, str]) -> int:
    """Split the cores between the ranks of a node unless the user said otherwise."""
    if config.threads_per_rank:
        return config.threads_per_rank
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return max(1, usable_cores() // identity.local_world_size)


def wait_for_master(addr: str, port: int, timeout_s: float, initial_delay_s: float = 0.2,
                    max_delay_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> int:
    """Connect to the master until it accepts, with exponential backoff; returns the attempts made.

    A pod's DNS name appears seconds after the pod starts and its port opens later still, so a
    failed lookup or a refused connection is retried, not fatal, until the deadline.
    """
    deadline = clock() + timeout_s
    delay = initial_delay_s
    attempts = 0
    last_error = "no attempt made"
    while True:
        attempts += 1
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, max(0.5, delay))):
                return attempts
        except socket.gaierror as error:
            last_error = f"host name {addr!r} does not resolve ({error.strerror})"
        except OSError as error:
            last_error = f"connection to {addr}:{port} failed ({error.strerror or error})"
        remaining = deadline - clock()
        if remaining <= 0:
            raise RendezvousError(
                f"master {addr}:{port} not reachable after {timeout_s:g}s and {attempts} attempts; last: "
                f"{last_error}. Check MASTER_ADDR/MASTER_PORT, that rank 0 is running, and that the port is "
                f"open between nodes; raise --rendezvous-timeout-s if the master starts slowly"
            )
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, max_delay_s)


# How much later than --collective-timeout-s NCCL's watchdog may abort the process: after a gloo collective's
# timeout (the stop vote) or the progress watchdog (trainer.liveness, PROGRESS_GRACE_S later) has named the late
# rank, dumped the flight recorder and exited 200 by itself.
NCCL_WATCHDOG_MARGIN_S = 60.0


def nccl_timeout_s(collective_timeout_s: float) -> float:
    """The NCCL process group's timeout: the trainer's diagnosis (PROGRESS_GRACE_S and a few seconds after
    --collective-timeout-s at the latest) must end the process before NCCL's watchdog aborts it without one."""
    return collective_timeout_s + max(NCCL_WATCHDOG_MARGIN_S, PROGRESS_GRACE_S * 3, 0.1 * collective_timeout_s)


def open_store(config: DistConfig, identity: DistIdentity) -> dist.Store:
    """The key-value store the ranks of a group of more than one meet in, before the group: it needs no device, so
    a rank that cannot have its device can still tell the others (trainer.doctor.driver)."""
    if not identity.is_main:
        # Rank 0 hosts the store on MASTER_PORT; the others wait for it to listen.
        wait_for_master(identity.master_addr, identity.master_port, config.rendezvous_timeout_s)
    return _store(identity, config)


def init_process_group(config: DistConfig, identity: DistIdentity, device: torch.device,
                       store: dist.Store | None = None) -> Runtime:
    """``store``: open_store's, when the caller met the others there first."""
    backend = choose_backend(config, device)
    timeout = timedelta(seconds=config.collective_timeout_s)
    if device.type == "cuda":
        try:
            torch.cuda.set_device(device)  # where CUDA starts
        except RuntimeError as error:
            refusal = cuda_driver.start_failure(error)
            if refusal is None:
                raise
            raise DeviceError(refusal) from None
    if identity.world_size == 1:
        # One process needs no network: an in-memory store keeps every collective code path the same.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        if store is None:
            store = open_store(config, identity)
        watch = PeerWatch(store, identity)  # its address published before any rank can wait for it
        # NCCL's watchdog ends the process at its timeout with no word of which rank was late: it is placed
        # after the trainer's own diagnosis (the control group's gloo timeout, the progress watchdog).
        training_timeout = timedelta(seconds=nccl_timeout_s(config.collective_timeout_s)) if backend == "nccl" \
            else timeout
        dist.init_process_group(backend, store=store, rank=identity.rank, world_size=identity.world_size,
                                timeout=training_timeout)
        control = dist.new_group(backend="gloo", timeout=timeout)
        watch.start(store, config.rendezvous_timeout_s)
        liveness = Liveness(store, identity, config.collective_timeout_s, peer_watch=watch)
        return Runtime(identity, device, backend, liveness, control)
    return Runtime(identity, device, backend)


def _store(identity: DistIdentity, config: DistConfig) -> dist.Store:
    """The key-value store the ranks meet in: rank 0's own, or torchrun's agent store (see below)."""
    timeout = timedelta(seconds=config.rendezvous_timeout_s)
    try:
        store = dist.TCPStore(identity.master_addr, identity.master_port, identity.world_size,
                              is_master=identity.is_main and not identity.agent_store, timeout=timeout,
                              wait_for_workers=False)
        return _fresh_store(store, identity, config) if identity.agent_store else store
    except (RuntimeError, OSError) as error:
        raise RendezvousError(
            f"rank {identity.rank} could not open the store at {identity.master_addr}:{identity.master_port}: "
            f"{first_line(error)}. Check MASTER_ADDR/MASTER_PORT (rank 0 must be able to listen on that port, "
            f"the others to reach it) and raise --rendezvous-timeout-s if ranks start far apart"
        ) from None


FRESH_STORE_KEY = "ddp-deploy/fresh-store"
TOKEN_KEY = "ddp-deploy/token"


def _fresh_store(agent_store: dist.TCPStore, identity: DistIdentity, config: DistConfig) -> dist.TCPStore:
    """A store that only this round's ranks have written to.

    torchrun's agent keeps its store across worker restarts, with the dead workers' keys in it: the
    restarted ranks would read old gloo addresses and wait for them until the timeout. No key prefix
    fixes that, because nothing the ranks know tells them apart from the previous round (restart
    counts differ between nodes: a node restarted for another node's failure does not count it).
    So rank 0 (on MASTER_ADDR's host) opens a new store on a free port and announces it with a
    random token; the others accept an announcement only when a store answers there with that
    token, which an announcement left by a dead rank 0 never does.
    """
    timeout = timedelta(seconds=config.rendezvous_timeout_s)
    if identity.is_main:
        fresh = dist.TCPStore(identity.master_addr, 0, identity.world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        token = uuid.uuid4().hex
        fresh.set(TOKEN_KEY, token)
        agent_store.set(FRESH_STORE_KEY, f"{fresh.port}:{token}")
        return fresh
    deadline = time.monotonic() + config.rendezvous_timeout_s
    while True:
        port, token = agent_store.get(FRESH_STORE_KEY).decode().split(":")
        try:
            candidate = dist.TCPStore(identity.master_addr, int(port), identity.world_size, is_master=False,
                                      timeout=timedelta(seconds=2))
            if candidate.get(TOKEN_KEY).decode() == token:
                # The short timeout was for probing announcements; the store's clones (trainer.liveness)
                # connect with this one, and 8 ranks starting on 2 cores can take longer than 2 s.
                candidate.set_timeout(timeout)
                return candidate
        except (RuntimeError, OSError):
            pass  # the announcement of a rank 0 that is gone: wait for the new one
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rank {identity.rank}: rank 0 never announced a reachable store through torchrun's store at "
                f"{identity.master_addr}:{identity.master_port} within {config.rendezvous_timeout_s:g}s; "
                f"check that rank 0 started and that its host accepts connections on any port"
            )
        time.sleep(0.2)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def process_group(config: DistConfig, identity: DistIdentity, device: torch.device,
                  store: dist.Store | None = None) -> Iterator[Runtime]:
    runtime = init_process_group(config, identity, device, store)
    try:
        yield runtime
    finally:
        if runtime.liveness is not None:
            runtime.liveness.close()
        destroy_process_group()


def _all_ranks_number(number: int, op: dist.ReduceOp.RedOpType, runtime: Runtime) -> int:
    if runtime.control is None:
        return number  # no other rank to ask: no collective
    value = torch.tensor([number], dtype=torch.int64)  # on the CPU: the control group is gloo's
    dist.all_reduce(value, op=op, group=runtime.control)
    return int(value.item())


def _all_ranks_flag(flag: bool, op: dist.ReduceOp.RedOpType, runtime: Runtime) -> bool:
    return bool(_all_ranks_number(1 if flag else 0, op, runtime))


def largest(number: int, runtime: Runtime) -> int:
    """The largest of every rank's number (a count of batches, say)."""
    return _all_ranks_number(number, dist.ReduceOp.MAX, runtime)


def agree(ok: bool, runtime: Runtime) -> bool:
    """True only if every rank says ok: turns one rank's failure into every rank's clean error, not a hang."""
    return _all_ranks_flag(ok, dist.ReduceOp.MIN, runtime)


def any_rank(flag: bool, runtime: Runtime) -> bool:
    """True if at least one rank raised the flag."""
    return _all_ranks_flag(flag, dist.ReduceOp.MAX, runtime)


def agreed(runtime: Runtime, step: Callable[[], T], error_type: type[UserError] = UserError,
           long_work: str = "") -> T:
    """Run ``step`` on every rank, then agree: a failure on any rank is raised on every rank.

    A UserError becomes the lowest failing rank's message, on every rank, as ``error_type``. An
    unexpected exception (a bug, not bad input) keeps its traceback on its own rank; the others raise
    ``error_type`` naming that rank. ``long_work``: what the step is when it can take longer than
    --collective-timeout-s on some ranks (a download): the others wait while those ranks are alive.
    """
    failure: Exception | None = None
    try:
        value = step()
    except Exception as error:  # every failure must reach the agreement, or the other ranks hang in it
        failure = error
    if long_work:
        runtime.wait_for_all(long_work)
    if failure is not None:
        _fail_everywhere(runtime, failure, error_type)
    if runtime.identity.distributed and not agree(True, runtime):
        _fail_everywhere(runtime, None, error_type)
    return value


def _fail_everywhere(runtime: Runtime, error: Exception | None, error_type: type[UserError]) -> NoReturn:
    if error is not None and not runtime.identity.distributed:
        raise error
    if error is not None:
        agree(False, runtime)
    reports: list[tuple[str, int] | None] = [None] * runtime.identity.world_size
    code = error.exit_code if isinstance(error, UserError) else error_type.exit_code
    dist.all_gather_object(reports, None if error is None else (_report(error, runtime), code), group=runtime.control)
    if error is not None and not isinstance(error, UserError):
        raise error
    # A failing rank's exit code on every rank: a store that kept failing (200, retried by the launcher) is not bad
    # input (2) because another rank raises it. Where ranks differ, the lowest code: input to fix outranks a retry,
    # which would fail the same way again.
    message, exit_code = min((report for report in reports if report is not None), key=lambda report: report[1])
    agreed_error = error_type(message)
    agreed_error.exit_code = exit_code
    raise agreed_error


def _report(error: Exception, runtime: Runtime) -> str:
    where = f"rank {runtime.identity.rank} on {runtime.identity.hostname}"
    if isinstance(error, UserError):
        # An agreement inside another (data loading inside a task's datasets()) names the rank once.
        return str(error) if "(seen by rank " in str(error) else f"{error} (seen by {where})"
    return f"{where} failed: {type(error).__name__}: {error}"


class StopVote:
    """Whether any rank asked to stop, agreed without ever waiting: on a GPU, or on the network.

    Each call starts this step's vote (an asynchronous all-reduce of a CPU flag over the control
    group, trainer.distributed.Runtime.control) and returns the previous step's outcome, which has
    long arrived by then. Every rank reads the same outcome at the same step, so all of them stop
    together, one step after the first vote that saw the signal.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.group = runtime.control
        self.votes = 0  # started so far: one per training step (the CPU test counts them)
        self._ballot = torch.zeros(1, dtype=torch.int32)
        self._pending: dist.Work | None = None

    def __call__(self, stop_here: bool) -> bool:
        self.votes += 1
        if self.group is None:
            return stop_here  # one process: nobody to agree with
        decided = self._outcome()
        self._ballot = torch.tensor([1 if stop_here else 0], dtype=torch.int32)
        self._pending = dist.all_reduce(self._ballot, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return decided

    def settle(self) -> bool:
        """The outcome of the last vote, waited for: call on every rank where the training loop ends, so that
        no vote is left in flight (and a signal in the last step is not missed)."""
        return self._outcome()

    def _outcome(self) -> bool:
        if self._pending is None:
            return False
        self._pending.wait()
        self._pending = None
        return bool(self._ballot.item())  # host memory: reading it waits for nothing


def broadcast_from_main(value: T, runtime: Runtime) -> T:
    """Rank 0's Python value on every rank (pickled in transit, between the job's own processes only)."""
    if runtime.identity.world_size == 1:
        return value
    holder: list[object] = [value]
    dist.broadcast_object_list(holder, src=0, group=runtime.control)
    return holder[0]  # type: ignore[return-value]


def gather_to_main(value: T, runtime: Runtime) -> list[T] | None:
    """Every rank's value, in rank order, on rank 0; None elsewhere."""
    if runtime.identity.world_size == 1:
        return [value]
    gathered: list[object] | None = [None] * runtime.identity.world_size if runtime.is_main else None
    dist.gather_object(value, gathered, dst=0, group=runtime.control)
    return gathered  # type: ignore[return-value]
