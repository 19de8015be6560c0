"""Which peer processes are gone, known within a second rather than after a heartbeat has been silent for
--collective-timeout-s.

A rank that waits for others in the store (trainer.liveness.wait_for_all: rank 0's checkpoint write, a node's
download) sees a dead peer and a frozen one alike: both stop beating. But when a process ends (crashed, killed,
out of memory, its pod deleted) its kernel closes its connections, and a frozen one's (SIGSTOP, a paused VM)
stay open. So each rank listens on a TCP port of its own and holds a connection to the next rank around the ring,
on which nothing is ever sent: its end is the peer's end. TCP keep-alives find a machine that vanished without
closing anything (powered off, cut off) in about a minute (KEEPALIVE_*). The watcher notes the peer as gone and
moves on to the rank after it: a lost node's ranks are all found by the surviving rank before them. A rank that
waits in the store publishes what its own watch found there, and reads what the others' found
(trainer.liveness).

Plain sockets, not a gloo group: a thread blocked in a gloo wait when the interpreter ends takes the process down
with SIGABRT (pybind11 cannot unwind it), and a finished job would exit 134. A thread blocked in a socket call
ends with the process. The watcher never touches the store, for the same reason.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from trainer.launchers import DistIdentity

GONE_KEY = "ddp-deploy/gone/"
ADDRESS_KEY = "ddp-deploy/watch-address/"
# How far around the ring a rank may walk: past a whole lost node of 8 or 16 ranks, without reading every rank's
# address at the start of a large job.
WATCHED_AHEAD = 32
# A peer whose machine stops answering TCP at all: found after IDLE + INTERVAL x COUNT seconds (a stopped process
# on a live machine still answers: its kernel does).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 30, 10, 3
CONNECT_TIMEOUT_S = 10.0
UNWATCHABLE = "-"  # a rank that could not listen: the walk stops there (its heartbeat still tells)


def gone_key(rank: int) -> str:
    return f"{GONE_KEY}{rank}"


class PeerWatch:
    """Made on every rank at once (it waits for the others' addresses); then watches from threads of its own."""

    def __init__(self, store: dist.Store, identity: DistIdentity, timeout_s: float) -> None:
        self.identity = identity
        self._gone: dict[int, str] = {}  # rank: how it went
        self._lock = threading.Lock()
        self._kept: list[socket.socket] = []  # the watchers' connections to this rank: open while it lives
        host = address_towards(identity.master_addr, identity.master_port)
        try:
            self._listener: socket.socket | None = socket.create_server((host, 0), family=_family(host),
                                                                        backlog=WATCHED_AHEAD)
            published = f"{host} {self._listener.getsockname()[1]}"
        except OSError:  # published all the same: the others must not wait for it
            self._listener, published = None, UNWATCHABLE
        store.set(f"{ADDRESS_KEY}{identity.rank}", published)
        world = identity.world_size
        ahead = [(identity.rank + step) % world for step in range(1, min(world - 1, WATCHED_AHEAD) + 1)]
        keys = [f"{ADDRESS_KEY}{rank}" for rank in ahead]
        store.wait(keys, timedelta(seconds=timeout_s))
        self._ahead = list(zip(ahead, (value.decode() for value in store.multi_get(keys)), strict=True))
        if self._listener is not None:
            threading.Thread(target=self._accept, name="peer-watch-accept", daemon=True).start()
        threading.Thread(target=self._watch, name="peer-watch", daemon=True).start()

    def found(self) -> dict[int, str]:
        """The peers this rank's watch found gone so far, and how."""
        with self._lock:
            return dict(self._gone)

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            self._kept.append(connection)  # never read: closing it (this process's end) is the message

    def _watch(self) -> None:
        for rank, address in self._ahead:
            if address == UNWATCHABLE:
                return
            host, port = address.rsplit(" ", 1)
            try:
                connection = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
            except ConnectionRefusedError:  # its machine answers, its port is closed: the process has ended
                self._note(rank, "its port is closed")
                continue
            except OSError:
                return  # not reachable from here (a network this rank does not see): the heartbeats still are
            with connection:
                _keep_alive(connection)
                connection.settimeout(None)
                try:
                    ended = connection.recv(1) == b""
                    how = "its connection closed" if ended else "it sent data on the watch connection"
                except TimeoutError:
                    how = f"its machine stopped answering TCP keep-alives ({_keepalive_s()} s)"
                except OSError as error:
                    how = f"its connection failed ({error.strerror or error})"
            self._note(rank, how)

    def _note(self, rank: int, how: str) -> None:
        with self._lock:
            self._gone[rank] = how


def address_towards(master_addr: str, master_port: int) -> str:
    """This machine's address on the route to the master: the one the other ranks reach it by too."""
    family = _family(master_addr)
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((master_addr, master_port))  # UDP: picks the route, sends nothing
        return str(probe.getsockname()[0])
    return "127.0.0.1" if family == socket.AF_INET else "::1"


def _family(host: str) -> socket.AddressFamily:
    with contextlib.suppress(OSError):
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    return socket.AF_INET


def _keep_alive(connection: socket.socket) -> None:
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, option):  # Linux's; elsewhere the system's defaults (hours)
            connection.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _keepalive_s() -> int:
    return KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT

