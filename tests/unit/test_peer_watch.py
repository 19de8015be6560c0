"""A peer that is gone is told from one that is frozen, within a second: three real processes in a gloo group,
two waiting in the store for the third (trainer.liveness.wait_for_all, as rank 0's checkpoint write is waited
for). Killed, the third is named gone by its watcher (rank 1: the ring's) and both waiters stop at once, far
before the silence limit; stopped (SIGSTOP), it is not gone, and the silence limit names it. And the watch
never changes how a process ends: ranks that exit normally, one after the other, exit 0."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from devtools.processes import free_port
from tests.support.spawned import SPAWN, spawned
from trainer.config import DistConfig
from trainer.distributed import init_process_group, process_group
from trainer.errors import PeerLost
from trainer.launchers import DistIdentity
from trainer.peer_watch import PeerWatch

pytestmark = pytest.mark.timeout(120)
SILENT_AFTER_S = 6.0  # --collective-timeout-s: the silence that names a frozen rank


def _rank(rank: int, port: int, ready: mp.Queue[int], results: mp.Queue[tuple[int, str, float]]) -> None:
    identity = DistIdentity(rank, 0, 3, 1, rank, 3, "127.0.0.1", port, "env", "h")
    runtime = init_process_group(DistConfig(collective_timeout_s=SILENT_AFTER_S), identity, torch.device("cpu"))
    watch = runtime.liveness.peer_watch  # type: ignore[union-attr]
    while watch.watching != (rank + 1) % 3:  # its connection to the next rank is made (2 cores can be slow)
        time.sleep(0.05)
    ready.put(rank)
    if rank == 2:
        time.sleep(120)  # killed or stopped by the test meanwhile
    started = time.monotonic()
    try:
        runtime.wait_for_all("the save")
        results.put((rank, "returned", time.monotonic() - started))
    except PeerLost as error:
        results.put((rank, str(error), time.monotonic() - started))
    except BaseException as error:  # noqa: BLE001 - told to the test, which fails on it
        results.put((rank, f"{type(error).__name__}: {error}", time.monotonic() - started))
    results.close()
    results.join_thread()  # sent before the exit, which skips the queue's own flush
    if rank == 0:
        time.sleep(3)  # the store's host: rank 1 may still be reading it
    os._exit(0)  # no teardown with a peer dead or stopped


def waiters_after(fault: signal.Signals) -> dict[int, tuple[str, float]]:
    ready, results, port = SPAWN.Queue(), SPAWN.Queue(), free_port()
    with spawned(_rank, [(rank, port, ready, results) for rank in range(3)]) as ranks:
        for _ in ranks:
            ready.get(timeout=60)
        time.sleep(1)  # ranks 0 and 1 are waiting for rank 2
        os.kill(ranks[2].pid, fault)
        said = [results.get(timeout=30) for _ in range(2)]
        ranks[2].kill()  # a stopped one too
    return {rank: (message, waited_s) for rank, message, waited_s in said}


def test_a_killed_peer_is_named_gone_at_once_and_a_stopped_one_only_after_the_silence_limit():
    killed = waiters_after(signal.SIGKILL)
    for rank in (0, 1):  # rank 0 learns it from rank 1's watch, through the store
        message, waited_s = killed[rank]
        assert message.startswith("rank 2 is gone while the others waited for the save: its connection closed and "
                                  "its port is closed (its process ended"), killed
        assert waited_s < 1 + 3, killed  # the second before the kill, and less than the silence limit
    stopped = waiters_after(signal.SIGSTOP)
    for rank in (0, 1):
        message, waited_s = stopped[rank]
        assert message.startswith("rank 2 stopped responding while the others waited for the save"), stopped
        assert waited_s >= SILENT_AFTER_S, stopped


def _exits(rank: int, port: int, delay_s: float) -> None:
    identity = DistIdentity(rank, 0, 3, 1, rank, 3, "127.0.0.1", port, "env", "h")
    with process_group(DistConfig(collective_timeout_s=30), identity, torch.device("cpu")):
        time.sleep(delay_s * rank)  # each peer's end reaches the watches of the others while they end too
    # A normal end of the interpreter from here: a thread of the watch must not abort it (SIGABRT, -6).


@pytest.mark.parametrize("delay_s", [0.0, 0.1])
def test_ranks_that_end_one_after_the_other_exit_0(delay_s):
    port = free_port()
    with spawned(_exits, [(rank, port, delay_s) for rank in range(3)]) as ranks:
        for process in ranks:
            process.join(timeout=60)
    assert [process.exitcode for process in ranks] == [0, 0, 0]


def test_a_peer_that_cannot_be_verified_is_never_called_gone_and_close_ends_the_watch():
    """An address other hosts cannot use (a loopback name on the peer's machine, a firewall: refused at once), or
    one where something else answers: not watched, never gone (its heartbeat still tells). close() ends the
    threads and sockets, as a process that runs several trainings needs."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]  # nothing listens there once this closes
    stranger = socket.create_server(("127.0.0.1", 0))  # answers, but with no greeting
    threads_before = {thread.name for thread in threading.enumerate()}
    for address in (f"127.0.0.1 {closed_port} ddp-deploy 1 token",
                    f"127.0.0.1 {stranger.getsockname()[1]} ddp-deploy 1 token"):
        store = dist.HashStore()
        store.set("ddp-deploy/watch-address/1", address)
        watch = PeerWatch(store, DistIdentity(0, 0, 2, 1, 0, 2, "127.0.0.1", closed_port, "env", "h"))
        watch.start(store, timeout_s=5)
        time.sleep(1.5)
        assert watch.found() == {} and watch.watching is None, address
        watch.close()
    stranger.close()
    deadline = time.monotonic() + 5
    while {thread.name for thread in threading.enumerate()} - threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not {thread.name for thread in threading.enumerate()} - threads_before
