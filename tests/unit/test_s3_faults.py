"""The fault proxy (devtools.s3_faults) with real s3fs through it: requests pass unchanged, signatures included,
and each fault fails the requests it picks, for its time, as s3fs shows it to the trainer."""

from __future__ import annotations

import errno
import hashlib
import http.client
import re
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest
import s3fs
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.exceptions import EndpointConnectionError

from devtools.s3_faults import FaultProxy, matching


def filesystem(proxy: FaultProxy) -> s3fs.S3FileSystem:
    """s3fs through the proxy, one try per call (botocore's and s3fs's retries off; aiohttp still retries an
    idempotent request once when its connection breaks)."""
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, endpoint_url=proxy.endpoint,
                           key=proxy.env["AWS_ACCESS_KEY_ID"], secret=proxy.env["AWS_SECRET_ACCESS_KEY"],
                           client_kwargs={"region_name": "us-east-1"},
                           config_kwargs={"retries": {"total_max_attempts": 1}})
    fs.retries = 1
    return fs


@pytest.fixture
def fs(s3_faults: FaultProxy) -> s3fs.S3FileSystem:
    return filesystem(s3_faults)


@pytest.fixture
def bucket(s3) -> str:
    return s3.new_bucket()


def outcomes(proxy: FaultProxy, since: int = 0) -> list[tuple[str, int | None, str | None]]:
    return [(exchange.method, exchange.status, exchange.fault) for exchange in proxy.log[since:]]


def test_requests_pass_through_unchanged(s3_faults, fs, bucket):
    fs.pipe_file(f"{bucket}/ckpt/step 1/a=b.pt", b"weights")  # a key that the path encodes
    assert fs.cat_file(f"{bucket}/ckpt/step 1/a=b.pt") == b"weights"
    assert fs.cat_file(f"{bucket}/ckpt/step 1/a=b.pt", start=1, end=4) == b"eig"  # a ranged GET
    assert fs.ls(f"{bucket}/ckpt/step 1") == [f"{bucket}/ckpt/step 1/a=b.pt"]  # a listing, with its query
    large = bytes(range(256)) * (11 << 12)  # 11 MiB in 5 MiB parts: a multipart upload (POSTs, parts' queries)
    with fs.open(f"{bucket}/ckpt/large", "wb", block_size=5 << 20) as handle:
        handle.write(large)
    assert fs.cat_file(f"{bucket}/ckpt/large") == large
    # The lease's conditional write (If-None-Match: *) reaches the server, which refuses the second.
    with fs.open(f"{bucket}/ckpt/.lease/holder", "xb") as handle:
        handle.write(b"job-a")
    with pytest.raises(FileExistsError), fs.open(f"{bucket}/ckpt/.lease/holder", "xb") as handle:
        handle.write(b"job-b")
    assert fs.cat_file(f"{bucket}/ckpt/.lease/holder") == b"job-a"
    fs.rm(f"{bucket}/ckpt", recursive=True)
    assert fs.ls(bucket) == []
    # Many requests at once, on connections kept alive between requests.
    fs.pipe({f"{bucket}/many/{index}": str(index).encode() for index in range(16)})
    assert fs.cat([f"{bucket}/many/{index}" for index in range(16)]) == {
        f"{bucket}/many/{index}": str(index).encode() for index in range(16)}
    log = s3_faults.log
    assert {"HEAD", "GET", "PUT", "POST"} <= {exchange.method for exchange in log}  # POST: uploads, deletes
    assert 412 in [exchange.status for exchange in log]
    assert s3_faults.forwarded == len(log) and s3_faults.failed() == 0
    assert s3_faults.connections < len(log) / 2


def test_a_chunked_request_body_passes_as_sent(s3_faults, fs, bucket):
    host, port = s3_faults.endpoint.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("PUT", f"/{bucket}/chunked", body=iter([b"ab", b"", b"cd", b"ef"]), encode_chunked=True)
    assert connection.getresponse().status == 200
    assert fs.cat_file(f"{bucket}/chunked") == b"abcdef"


class Recorder(socketserver.StreamRequestHandler):
    """A server's handler that keeps the bytes of each request it gets (head, body) and answers 200."""

    def handle(self) -> None:
        head = b"".join(iter(lambda: self.rfile.readline(), b"\r\n")) + b"\r\n"
        if b"Expect: 100-continue" in head:
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        length = re.search(rb"Content-Length: (\d+)", head)
        self.server.requests.append((head, self.rfile.read(int(length[1])) if length else b""))
        self.wfile.write(b'HTTP/1.1 200 OK\r\nETag: "1"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n')


@pytest.fixture
def recorded(s3) -> Iterator[tuple[FaultProxy, list[tuple[bytes, bytes]]]]:
    """A proxy in front of a Recorder, and the requests that reached it."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Recorder)
    server.requests = []
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    proxy = FaultProxy(f"http://127.0.0.1:{server.server_address[1]}", s3.env).start()
    yield proxy, server.requests
    proxy.close()
    server.shutdown()
    server.server_close()


def signed(head: bytes, body: bytes) -> bool:
    """Whether the request's SigV4 signature holds for these bytes (as a store that checks signatures decides)."""
    first, *lines = head.decode().strip().split("\r\n")
    method, target, _ = first.split(" ")
    headers = dict(line.split(": ", 1) for line in lines)
    authorization = headers.pop("Authorization")
    names = re.search(r"SignedHeaders=([^,]+)", authorization)[1].split(";")
    request = AWSRequest(method, f"http://{headers['Host']}{target}",
                         {name: value for name, value in headers.items() if name.lower() in names}, body)
    request.context["timestamp"] = headers["X-Amz-Date"]
    signer = S3SigV4Auth(Credentials("test-key", "test-secret"), "s3", "us-east-1")
    signature = signer.signature(signer.string_to_sign(request, signer.canonical_request(request)), request)
    return authorization.endswith(f"Signature={signature}") and \
        headers["X-Amz-Content-SHA256"] == hashlib.sha256(body).hexdigest()


def test_signed_requests_reach_the_server_as_signed(recorded):
    proxy, requests = recorded
    filesystem(proxy).pipe_file("bucket/ckpt/step 1/a=b.pt", b"weights")
    [(head, body)] = requests
    assert body == b"weights" and f"Host: 127.0.0.1:{proxy.endpoint.rsplit(':', 1)[1]}\r\n".encode() in head
    assert signed(head, body)
    assert not signed(head.replace(b"Host: 127.0.0.1", b"Host: localhost"), body), "the check checks the Host"
    assert not signed(head, b"weightz"), "and the body"


@pytest.mark.parametrize(("kind", "status", "raised", "code", "message"), [
    ("slowdown", 503, OSError, errno.EBUSY, "Please reduce your request rate."),
    ("error500", 500, OSError, errno.EREMOTEIO, "We encountered an internal error. Please try again."),
    ("reset", None, EndpointConnectionError, None, "Could not connect to the endpoint URL"),
])
def test_a_fault_fails_requests_as_s3fs_shows_them(s3_faults, fs, bucket, kind, status, raised, code, message):
    s3_faults.fail(kind, 60)
    with pytest.raises(raised, match=re.escape(message)) as failed:
        fs.pipe_file(f"{bucket}/ckpt/state.pt", b"weights")
    assert getattr(failed.value, "errno", None) == code
    tries = 2 if kind == "reset" else 1  # aiohttp sends a PUT again once when its connection breaks
    assert outcomes(s3_faults) == [("PUT", status, kind)] * tries
    assert s3_faults.failed(kind) == s3_faults.failed() == tries and s3_faults.forwarded == 0
    s3_faults.clear()
    fs.pipe_file(f"{bucket}/ckpt/state.pt", b"weights")
    assert fs.cat_file(f"{bucket}/ckpt/state.pt") == b"weights"


def test_a_fault_ends_after_its_seconds(s3_faults, fs, bucket):
    fault = s3_faults.fail("error500", 2.0)  # longer than the client's own retries, even on a loaded machine
    with pytest.raises(OSError):
        fs.pipe_file(f"{bucket}/a", b"1")
    time.sleep(max(0.0, fault.ends_at - time.monotonic()))
    fs.pipe_file(f"{bucket}/a", b"1")
    assert outcomes(s3_faults) == [("PUT", 500, "error500"), ("PUT", 200, None)]


def test_a_fault_after_n_requests_starts_at_the_next_one(s3_faults, fs, bucket):
    fault = s3_faults.fail("slowdown", 60, match=matching(methods=["PUT"]), after=2)
    fs.pipe_file(f"{bucket}/a", b"1")
    fs.pipe_file(f"{bucket}/b", b"2")
    assert fs.cat_file(f"{bucket}/a") == b"1"  # not a PUT: neither counted nor failed
    assert fault.started is None
    with pytest.raises(OSError, match="reduce your request rate"):
        fs.pipe_file(f"{bucket}/c", b"3")
    assert fault.started is not None and fault.seen == 3
    assert [status for _, status, _ in outcomes(s3_faults)] == [200, 200, 200, 200, 503]  # cat_file: HEAD, GET


def test_a_fault_on_some_requests_leaves_the_others_alone(s3_faults, fs, bucket):
    s3_faults.fail("error500", 60, match=matching(methods=["PUT"], contains="/.lease/"))
    fs.pipe_file(f"{bucket}/ckpt/step-1/state.pt", b"weights")  # a PUT elsewhere
    with pytest.raises(OSError, match="internal error"):
        fs.pipe_file(f"{bucket}/ckpt/.lease/holder", b"job-a")
    assert fs.cat_file(f"{bucket}/ckpt/step-1/state.pt") == b"weights"
    assert fs.exists(f"{bucket}/ckpt/.lease/holder") is False  # a HEAD on the lease's key
    assert [exchange.path for exchange in s3_faults.log if exchange.fault] == [f"/{bucket}/ckpt/.lease/holder"]


def test_a_stall_holds_requests_until_its_end_or_a_clear(s3_faults, fs, bucket):
    fs.pipe_file(f"{bucket}/a", b"1")
    s3_faults.fail("stall", 1.0)
    started = time.monotonic()
    fs.pipe_file(f"{bucket}/b", b"2")  # held, its connection closed at the end, sent again by aiohttp
    assert 1.0 <= time.monotonic() - started < 5
    assert outcomes(s3_faults, 1) == [("PUT", None, "stall"), ("PUT", 200, None)]
    s3_faults.fail("stall", 60)
    started = time.monotonic()
    threading.Timer(0.3, s3_faults.clear).start()
    assert fs.cat_file(f"{bucket}/b") == b"2"
    assert 0.3 <= time.monotonic() - started < 5
