"""A server that vanishes and comes back, on loopback: a TCP port that forwards every connection, byte for byte, to
a real server (Azurite, which keeps its blobs only while it runs), and that a test closes (``stop``: open connections
reset, new ones refused, as a killed server's port does) and opens again on the same port (``start``). The server
behind it keeps what it stored, so a client sees its endpoint gone and then back with its data. Threads of the test
process; the client under test is a process of its own, given ``endpoint``."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator

COPY_BYTES = 1 << 16


class TcpGate:
    """``stop`` and ``start`` may be called from any thread while connections are served."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()  # every forwarded connection's two sockets
        self._listener: socket.socket | None = None
        self.port = 0  # the kernel's pick at the first start (port 0: no other process can take it in between)

    @property
    def open(self) -> bool:
        return self._listener is not None

    def start(self) -> TcpGate:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the same port again, its old ones in TIME_WAIT
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="tcp-gate", daemon=True).start()
        return self

    def stop(self) -> None:
        """The port closed (a connect is refused) and every open connection reset."""
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = list(self._sockets), set()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() that waits on it
            listener.close()
        for each in sockets:
            with contextlib.suppress(OSError):
                # Linger 0: close() sends RST, and the client sees "connection reset by peer".
                each.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                each.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # stopped
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # stopped while this one connected
                    client.close()
                    server.close()
                    return
                self._sockets.update((client, server))
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(source, target), name="tcp-gate-pump", daemon=True).start()


def _pump(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(COPY_BYTES):
            target.sendall(data)
        target.shutdown(socket.SHUT_WR)  # the peer's end of its request or answer, passed on
    except OSError:
        for each in (source, target):  # one side reset or was stopped: both end
            with contextlib.suppress(OSError):
                each.close()


@contextlib.contextmanager
def tcp_gate(upstream: tuple[str, int]) -> Iterator[TcpGate]:
    """A gate in front of ``upstream``, open; closed afterwards."""
    gate = TcpGate(upstream).start()
    try:
        yield gate
    finally:
        gate.stop()
