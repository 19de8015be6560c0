"""An S3 outage on loopback: an HTTP proxy in front of the S3-compatible server (devtools.s3_server) that forwards
every request unchanged and fails the ones a test chooses, for a time: S3's throttling (503 SlowDown), an internal
error (500), a reset connection or a stall. The proxy runs as threads of the test process, which turns faults on and
off; the trainer under test is a process of its own, given the proxy's URL as AWS_ENDPOINT_URL (``FaultProxy.env``).

Requests are forwarded as bytes, never re-encoded: SigV4 signs the Host header, the path and query and the payload's
hash, so a proxy that rewrote any of them would be refused by a store that checks signatures. Answers come back as
bytes too, less the server's Connection header (see _Connection._forward)."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from io import BufferedReader
from typing import Literal
from urllib.parse import unquote, urlsplit

from devtools.s3_server import S3Server

FaultKind = Literal["slowdown", "error500", "reset", "stall"]
Match = Callable[[str, str], bool]  # (method, path) -> whether a fault applies; path: /bucket/key, unquoted

# What S3 answers when it fails a request: (status line, error code, message), its own words.
ERRORS: dict[str, tuple[bytes, str, str]] = {
    "slowdown": (b"HTTP/1.1 503 Slow Down", "SlowDown", "Please reduce your request rate."),
    "error500": (b"HTTP/1.1 500 Internal Server Error", "InternalError",
                 "We encountered an internal error. Please try again."),
}
UPSTREAM_TIMEOUT_S = 120  # the server under the proxy answers at once; never wait on it for ever
COPY_BYTES = 1 << 16


def everything(method: str, path: str) -> bool:
    return True


def matching(methods: Iterable[str] = (), contains: str = "", under: str = "") -> Match:
    """Requests by method (any when none is named) and path: one containing a text (``"/.lease/"``), one under a
    prefix (``"/bucket/ckpt/"``). Paths are ``/bucket/key`` without the query: a listing is ``GET /bucket``."""
    methods = {method.upper() for method in methods}

    def match(method: str, path: str) -> bool:
        return (not methods or method in methods) and contains in path and path.startswith(under)

    return match


@dataclass
class Fault:
    """One way to fail requests: ``kind`` for ``seconds``, on the requests ``match`` picks, from when it is set or,
    with ``after``, from the first matching request after that many have passed."""

    kind: FaultKind
    seconds: float
    match: Match = everything
    after: int = 0
    started: float | None = None  # time.monotonic() of its start; None while it waits for its `after` requests
    seen: int = 0  # matching requests since it was set, the ones it let through before its start too
    cleared: threading.Event = field(default_factory=threading.Event)  # ends its stalls early

    def takes(self, method: str, path: str, now: float) -> bool:
        """Whether this request is one to fail (counted; called under the proxy's lock)."""
        if self.cleared.is_set() or not self.match(method, path):
            return False
        self.seen += 1
        if self.started is None and self.seen > self.after:
            self.started = now
        return self.started is not None and now < self.ends_at

    @property
    def ends_at(self) -> float:
        return float("inf") if self.started is None else self.started + self.seconds


@dataclass(frozen=True)
class Exchange:
    """One request the proxy saw, logged once it was answered (or failed)."""

    method: str
    path: str  # /bucket/key, unquoted
    query: str
    status: int | None  # None: no answer (a reset or a stall)
    fault: FaultKind | None  # None: forwarded
    at: float  # time.monotonic() when it arrived


class FaultProxy:
    """The proxy; ``fail`` and ``clear`` may be called from any thread while requests are served."""

    def __init__(self, upstream: str, env: Mapping[str, str] | None = None) -> None:
        address = urlsplit(upstream)
        self.upstream = (address.hostname or "127.0.0.1", address.port or 80)
        self._env = dict(env or {})  # the server's own (credentials, region), its endpoint replaced by the proxy's
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._log: list[Exchange] = []
        self._clients: set[socket.socket] = set()
        self.connections = 0  # client connections opened: fewer than requests while clients keep them alive
        # Port 0: the kernel picks a free port as the socket binds, so no other process can take it in between.
        self._server = _Server(("127.0.0.1", 0), _Connection)
        self._server.proxy = self
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="s3-fault-proxy",
                                        daemon=True)  # polls for shutdown every 50 ms: a quick close

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach the server through this proxy with s3fs (as S3Server.env)."""
        return {**self._env, "AWS_ENDPOINT_URL": self.endpoint}

    def fail(self, kind: FaultKind, seconds: float, match: Match | None = None, after: int = 0) -> Fault:
        """Fail the requests ``match`` picks (all by default) for ``seconds``, from now or, with ``after``, from the
        first of them after that many have passed ("after the first checkpoint"). Faults add up; a request that two
        of them pick gets the first one's."""
        if kind not in ("slowdown", "error500", "reset", "stall"):
            raise ValueError(f"no fault kind {kind!r}: slowdown, error500, reset or stall")
        fault = Fault(kind, seconds, match or everything, after, started=time.monotonic() if after == 0 else None)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        """No more faults; stalled requests end now (their connections closed)."""
        with self._lock:
            faults, self._faults = self._faults, []
        for fault in faults:
            fault.cleared.set()

    @property
    def log(self) -> list[Exchange]:
        with self._lock:
            return list(self._log)

    @property
    def forwarded(self) -> int:
        return sum(exchange.fault is None for exchange in self.log)

    def failed(self, kind: FaultKind | None = None) -> int:
        """Requests failed, of one kind or of any."""
        return sum(exchange.fault is not None and kind in (None, exchange.fault) for exchange in self.log)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        self.clear()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:  # idle keep-alive connections: their threads wait on the client's next request
            clients = list(self._clients)
        for client in clients:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)

    def _fault_for(self, method: str, path: str) -> Fault | None:
        now = time.monotonic()
        with self._lock:
            taken = [fault for fault in self._faults if fault.takes(method, path, now)]  # every fault counts it
        return taken[0] if taken else None

    def _record(self, exchange: Exchange) -> None:
        with self._lock:
            self._log.append(exchange)

    def _connected(self, client: socket.socket, open_: bool) -> None:
        with self._lock:
            if open_:
                self._clients.add(client)
                self.connections += 1
            else:
                self._clients.discard(client)


@contextlib.contextmanager
def s3_fault_proxy(server: S3Server) -> Iterator[FaultProxy]:
    """A fault proxy in front of ``server``, closed afterwards."""
    proxy = FaultProxy(server.endpoint, server.env).start()
    try:
        yield proxy
    finally:
        proxy.close()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    block_on_close = False  # close() ends the connections itself; never wait on a client that keeps one open
    allow_reuse_address = True
    proxy: FaultProxy


@dataclass
class _Head:
    """A request's or a response's first line and headers, as read (``raw``) and parsed for framing."""

    raw: bytes
    first: list[str]  # request: method, target, version; response: version, status, reason
    headers: dict[str, str]  # names lowercased

    @classmethod
    def read(cls, reader: BufferedReader) -> _Head | None:
        """The next head on the connection; None when the peer closed it between messages."""
        lines = []
        while (line := reader.readline(COPY_BYTES)) not in (b"\r\n", b"\n"):
            if not line:
                if lines:
                    raise ConnectionError("the connection closed inside a message's head")
                return None
            lines.append(line)
        fields = (line.decode("latin-1").split(":", 1) for line in lines[1:])
        headers = {name.strip().lower(): value.strip() for name, value in fields}
        return cls(b"".join(lines) + line, lines[0].decode("latin-1").split(" ", 2), headers)

    def has(self, name: str, token: str) -> bool:
        return token in self.headers.get(name, "").lower()

    def without(self, name: str) -> bytes:
        """The head as read, less the header ``name``."""
        lines = self.raw.split(b"\r\n")
        prefix = f"{name}:".encode()
        return b"\r\n".join(line for line in lines if not line.lower().startswith(prefix))

    @property
    def status(self) -> int:
        return int(self.first[1])


class _Connection(socketserver.BaseRequestHandler):
    """One client connection: requests one after another on it (botocore keeps connections alive)."""

    server: _Server
    request: socket.socket

    def handle(self) -> None:
        proxy = self.server.proxy
        proxy._connected(self.request, True)
        reader = self.request.makefile("rb")
        try:
            while self._exchange(proxy, reader):
                pass
        except (OSError, ValueError, IndexError):
            pass  # the client or the server went away mid-message, or sent no HTTP: the connection ends
        finally:
            reader.close()
            proxy._connected(self.request, False)

    def _exchange(self, proxy: FaultProxy, reader: BufferedReader) -> bool:
        """One request and its answer; whether the connection carries another."""
        request = _Head.read(reader)
        if request is None:
            return False
        arrived = time.monotonic()
        method, parts = request.first[0], urlsplit(request.first[1])
        path = unquote(parts.path)
        fault = proxy._fault_for(method, path)

        def record(status: int | None) -> None:
            # Before the client can see the answer end: a test that asserts on the log once its call returned
            # finds the request there.
            proxy._record(Exchange(method, path, parts.query, status, fault.kind if fault else None, arrived))

        # The client's connection stays usable only while both sides agree where each message ends.
        keep = not request.has("connection", "close")
        if fault is None:
            return self._forward(request, reader, proxy.upstream, record) and keep
        if fault.kind in ERRORS:
            return self._error(fault.kind, request, reader, record) and keep
        record(None)
        if fault.kind == "reset":
            reader.close()  # the socket's file must go first, or close() below would not close it yet
            # Linger 0: close() sends RST instead of FIN, and the client sees "connection reset by peer".
            self.request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.request.close()
        else:  # a stall: the request is taken and never answered until the fault ends; then the connection closes
            fault.cleared.wait(max(0.0, fault.ends_at - time.monotonic()))
        return False

    def _error(self, kind: str, request: _Head, reader: BufferedReader, record: Callable[[int], None]) -> bool:
        """S3's answer for ``kind``; whether the connection stays usable."""
        status_line, code, message = ERRORS[kind]
        # Expect: 100-continue: without a 100 the client never sends its body and S3 answers at once; the
        # connection closes then, as it might still carry the body. Otherwise the body is read past.
        expecting = request.has("expect", "100-continue")
        if not expecting:
            _copy_body(reader, request, lambda data: None)
        request_id = uuid.uuid4().hex[:16].upper()
        body = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
                f"<Error><Code>{code}</Code><Message>{message}</Message><RequestId>{request_id}</RequestId>"
                f"<HostId>s3-fault-proxy</HostId></Error>").encode()
        headers = [status_line, b"Content-Type: application/xml", f"x-amz-request-id: {request_id}".encode(),
                   f"Content-Length: {len(body)}".encode()] + ([b"Connection: close"] if expecting else [])
        record(int(status_line.split()[1]))
        # A HEAD is answered without a body, as S3 does (the client reads the code from the status alone).
        self.request.sendall(b"\r\n".join(headers) + b"\r\n\r\n" + (b"" if request.first[0] == "HEAD" else body))
        return not expecting

    def _forward(self, request: _Head, reader: BufferedReader, upstream: tuple[str, int],
                 record: Callable[[int], None]) -> bool:
        """The request to the server and its answer back, both as bytes; whether the client's connection stays
        usable. A connection to the server per request: nothing to tell a server's closed keep-alive connection
        from a failure then, and loopback connects in microseconds."""
        with socket.create_connection(upstream, timeout=UPSTREAM_TIMEOUT_S) as server, server.makefile("rb") as answers:
            server.sendall(request.raw)
            # Expect: 100-continue (botocore's PUTs): the client sends the body only once told to go on.
            body_sent = not request.has("expect", "100-continue")
            if body_sent:
                _copy_body(reader, request, server.sendall)
            while (response := _Head.read(answers)) is not None and response.status < 200:
                self.request.sendall(response.raw)  # 100 Continue (or another interim answer)
                if not body_sent:
                    _copy_body(reader, request, server.sendall)
                    body_sent = True
            if response is None:
                raise ConnectionError("the server closed the connection without an answer")
            bodiless = request.first[0] == "HEAD" or response.status in (204, 304)
            framed = bodiless or response.has("transfer-encoding", "chunked") or "content-length" in response.headers
            record(response.status)
            # Connection is hop-by-hop (RFC 9110, 7.6.1): the server's "close" (moto's web server closes after every
            # answer) is about its connection to the proxy, a new one per request. The client's stays open, as S3
            # keeps it, whenever the answer's end is framed; the request goes on as sent, its bytes are signed.
            self.request.sendall(response.without("connection") if framed else response.raw)
            if not bodiless:
                _copy_body(answers, response, self.request.sendall)
            return body_sent and framed


def _copy_body(reader: BufferedReader, head: _Head, write: Callable[[bytes], object]) -> None:
    """A message's body from ``reader`` to ``write``, as sent (chunked stays chunked)."""
    if head.has("transfer-encoding", "chunked"):
        while True:
            line = reader.readline(COPY_BYTES)
            write(line)
            size = int(line.split(b";", 1)[0], 16)  # ValueError at the end of the stream
            if size == 0:
                break
            _copy_exactly(reader, size + 2, write)  # the chunk and its CRLF
        while (line := reader.readline(COPY_BYTES)) not in (b"\r\n", b"\n", b""):  # trailers, then a blank line
            write(line)
        write(line)
    elif "content-length" in head.headers:
        _copy_exactly(reader, int(head.headers["content-length"]), write)
    elif head.first[0].startswith("HTTP/"):  # a response without a length ends where the connection does
        while data := reader.read1(COPY_BYTES):
            write(data)
    # (a request without a length has no body)


def _copy_exactly(reader: BufferedReader, size: int, write: Callable[[bytes], object]) -> None:
    while size:
        data = reader.read(min(size, COPY_BYTES))
        if not data:
            raise ConnectionError("the connection closed inside a message's body")
        write(data)
        size -= len(data)
