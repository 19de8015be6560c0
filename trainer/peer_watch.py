"""Which peer processes are gone, known within a second rather than after a heartbeat has been silent for
--collective-timeout-s.

A rank that waits for others in the store (trainer.liveness.wait_for_all: rank 0's checkpoint write, a node's
download) sees a dead peer and a frozen one alike: both stop beating. But when a process ends (crashed, killed,
out of memory, its pod deleted) its kernel closes its connections, and a frozen one's (SIGSTOP, a paused VM, a
network cut off for a while) stay open. So each rank listens on a TCP port of its own and holds a connection to
the next rank around the ring, on which nothing is sent after a greeting: its end is the peer's end. The watcher
notes the peer as gone and moves on to the rank after it: a lost node's ranks are all found by the surviving rank
before them. A rank that waits in the store publishes what its own watch found there, and reads what the others'
found (trainer.liveness).

Only what the peer's own kernel says counts: the verified connection closed or reset, and then its port closed
(refused) when connected to again. A peer that cannot be reached at all (an address other hosts do not see, a
firewall, a machine that vanished without a word) is never called gone: the walk stops there and its silent
heartbeat still tells. Plain sockets, not a gloo group: a thread blocked in a gloo wait when the interpreter ends
takes the process down with SIGABRT (pybind11 cannot unwind it); a thread blocked in a socket call ends with the
process. The watcher never touches the store, for the same reason.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from datetime import timedelta

import torch.distributed as dist

from trainer.launchers import DistIdentity

GONE_KEY = "ddp-deploy/gone/"
ADDRESS_KEY = "ddp-deploy/watch-address/"
# How far around the ring a rank may walk: past a whole lost node of 8 or 16 ranks, without reading every rank's
# address at the start of a large job.
WATCHED_AHEAD = 32
CONNECT_TIMEOUT_S = 10.0
UNWATCHABLE = "-"  # a rank that could not listen: the walk stops there (its heartbeat still tells)
RECONNECTS = 10  # a watch connection broken on the way (the peer alive) is made again this many times at most
RECONNECT_TRIES, RECONNECT_PAUSE_S = 5, 0.2
ACCEPT_PAUSE_S = 0.1


def gone_key(rank: int) -> str:
    return f"{GONE_KEY}{rank}"


class PeerWatch:
    """Listens and publishes its address at once (before the process group: nobody waits for a rank that died
    after joining the store); ``start``, on every rank once the group is made, reads the others' and watches."""

    def __init__(self, store: dist.Store, identity: DistIdentity) -> None:
        self.identity = identity
        self._gone: dict[int, str] = {}  # rank: how it went
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []  # the listener, the watchers' connections, this rank's own
        # Sent to each watcher on connecting: a connection that answers otherwise is to something else.
        self._greeting = f"ddp-deploy {identity.rank} {uuid.uuid4().hex}\n".encode()
        self._listener: socket.socket | None = None
        self.watching: int | None = None  # the rank this one holds a verified connection to, once it does
        published = UNWATCHABLE
        host = address_towards(identity.master_addr, identity.master_port)
        if host is not None:
            with contextlib.suppress(OSError):
                self._listener = socket.create_server((host, 0), family=_family(host), backlog=WATCHED_AHEAD)
                self._sockets.append(self._listener)
                published = f"{host} {self._listener.getsockname()[1]} {self._greeting.decode().strip()}"
        store.set(f"{ADDRESS_KEY}{identity.rank}", published)
        # A child forked from here (a DataLoader worker) must not hold this process's connections open after it.
        os.register_at_fork(after_in_child=self._forget_in_child)

    def start(self, store: dist.Store, timeout_s: float) -> None:
        world, rank = self.identity.world_size, self.identity.rank
        ahead = [(rank + step) % world for step in range(1, min(world - 1, WATCHED_AHEAD) + 1)]
        keys = [f"{ADDRESS_KEY}{peer}" for peer in ahead]
        store.wait(keys, timedelta(seconds=timeout_s))  # published before the group was made: no wait
        addresses = [value.decode() for value in store.multi_get(keys)]
        if self._listener is not None:
            threading.Thread(target=self._accept, name="peer-watch-accept", daemon=True).start()
        threading.Thread(target=self._watch, args=(list(zip(ahead, addresses, strict=True)),), name="peer-watch",
                         daemon=True).start()

    def found(self) -> dict[int, str]:
        """The peers this rank's watch found gone so far, and how."""
        with self._lock:
            return dict(self._gone)

    def close(self) -> None:
        """The end of this process group: every socket closed, the threads return (a process may run another)."""
        self._closed.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for each in sockets:
            with contextlib.suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept or recv on it
            each.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
                connection.sendall(self._greeting)
            except OSError:
                if self._closed.wait(ACCEPT_PAUSE_S):  # closed, or a passing failure (no file descriptors left)
                    return
                continue
            self._keep(connection)  # never read: closing it (this process's end) is the message

    def _watch(self, ahead: list[tuple[int, str]]) -> None:
        for rank, address in ahead:
            if address == UNWATCHABLE:
                return
            host, number, greeting = address.split(" ", 2)
            port = int(number)
            connection, _ = self._connect(host, port, greeting)
            for _ in range(RECONNECTS):
                if connection is None:
                    self.watching = None
                    return  # not reachable from here, or not the peer: its heartbeat still tells
                self.watching = rank
                with contextlib.suppress(OSError):
                    connection.recv(1)  # returns (or fails) only when the connection ends
                if self._closed.is_set():
                    return
                self._drop(connection)
                # The peer's kernel closed or reset it. Gone if its port is closed too (refused); a peer that
                # answers again (the connection broken on the way) is watched again.
                connection, refused = self._reconnect(host, port, greeting)
                if refused:
                    with self._lock:
                        self._gone[rank] = "its connection closed and its port is closed"
                    break
            else:
                return

    def _reconnect(self, host: str, port: int, greeting: str) -> tuple[socket.socket | None, bool]:
        """After the connection ended: a process that ends closes its connections one by one, and its listening
        port can still take a connection for a moment (closed then without a greeting): asked again, shortly."""
        for _ in range(RECONNECT_TRIES):
            connection, refused = self._connect(host, port, greeting)
            if connection is not None or refused or self._closed.wait(RECONNECT_PAUSE_S):
                return connection, refused
        return None, False

    def _connect(self, host: str, port: int, greeting: str) -> tuple[socket.socket | None, bool]:
        """A verified connection to the peer, or None and whether its machine refused it (the port closed)."""
        try:
            connection = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        except ConnectionRefusedError:
            return None, True
        except OSError:
            return None, False
        try:
            with connection.makefile("rb") as reader:
                said = reader.readline(len(greeting) + 1).decode(errors="replace").strip()
        except OSError:
            said = ""
        if said != greeting:
            connection.close()
            return None, False
        connection.settimeout(None)
        self._keep(connection)
        return connection, False

    def _keep(self, connection: socket.socket) -> None:
        with self._lock:
            if self._closed.is_set():
                connection.close()
                return
            self._sockets.append(connection)

    def _drop(self, connection: socket.socket) -> None:
        """A watch connection that ended: closed, not kept until the end of the group."""
        with self._lock:
            if connection in self._sockets:
                self._sockets.remove(connection)
        connection.close()

    def _forget_in_child(self) -> None:
        for each in self._sockets:
            with contextlib.suppress(OSError):
                each.close()  # the child's copy only: the parent's connections stay as they are
        self._sockets = []


def address_towards(master_addr: str, master_port: int) -> str | None:
    """This machine's address on the route to the master, the one the other ranks reach it by; None where that is a
    loopback address while the master is not one (a host name that resolves to 127.0.1.1 on its own machine: the
    other hosts would connect to themselves), or where there is no route."""
    family = _family(master_addr)
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((master_addr, master_port))  # UDP: picks the route, sends nothing
            host = str(probe.getsockname()[0])
        master_loopback = all(_is_loopback(info[4][0])
                              for info in socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM))
    except OSError:
        return None
    return None if _is_loopback(host) and not master_loopback else host


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def _family(host: str) -> socket.AddressFamily:
    with contextlib.suppress(OSError):
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    return socket.AF_INET
