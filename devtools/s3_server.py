"""A real S3-compatible server on loopback for the tests and the bench: moto's standalone server
(``moto_server``), the trainer reaching it through s3fs as it would reach AWS or MinIO (``AWS_ENDPOINT_URL`` and
credentials in the environment, ``s3://bucket/...`` URLs)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from devtools.processes import BIN_DIR, REPO_ROOT, clean_env, free_port, kill_session, wait_until_answers


class ServerDied(RuntimeError):
    """The S3 server stopped while a test or figure used it: the failure seen is the server's, not the caller's."""


@dataclass
class S3Server:
    process: subprocess.Popen[bytes]
    endpoint: str
    log: Path  # the server's request log: one line per request it answered

    def gets(self, key: str) -> int:
        """How many GET requests (a whole object or a range of it) the server answered for ``bucket/key``."""
        return sum(f"GET /{key} HTTP/" in line for line in self.log.read_text(errors="replace").splitlines())

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach this server with s3fs (botocore reads these)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "test-key",
                "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_DEFAULT_REGION": "us-east-1"}

    def new_bucket(self) -> str:
        """A fresh, empty bucket (its name)."""
        import boto3

        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="test-key",
                     aws_secret_access_key="test-secret", region_name="us-east-1").create_bucket(Bucket=name)
        return name

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """The server frozen (SIGSTOP): connections are accepted by the kernel and never answered, as a hung
        NFS server or an unreachable bucket behind a proxy; thawed afterwards."""
        os.kill(self.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.process.pid, signal.SIGCONT)


def still_serving(process: subprocess.Popen[bytes], port: int, exit_wait_s: float = 10) -> bool:
    """Whether the server ``process`` still listens on ``port``. Its exit code alone misses a server on its way
    out: werkzeug closes the listening socket first and the interpreter's exit follows. A frozen server
    (``stopped``) still listens: the kernel accepts for it. (The refusals CI saw in bench figure 17 were not a
    dying server but an older server's port: see forget_cached_s3_filesystems.)"""
    if process.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return True
        except TimeoutError:
            return True  # accepted by nobody in time, but not refused: a full backlog is a listening socket
        except OSError:
            pass  # refused: nothing listens there any more
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=exit_wait_s)  # for its exit code, if it is leaving
    return False


def forget_cached_s3_filesystems() -> None:
    """fsspec gives back one S3FileSystem per set of options, and the endpoint is not among them (botocore reads
    AWS_ENDPOINT_URL): a folder opened under a new server would get the instance made under an older one, whose
    server is gone. Bench figure 17 was refused so after figure 14's, in one process, in every CI run of both."""
    import s3fs  # here: only the S3 tests and figures need it

    s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def s3_server(timeout_s: float = 60) -> Iterator[S3Server]:
    port = free_port()
    folder = tempfile.TemporaryDirectory(prefix="s3-server-")
    log = Path(folder.name) / "requests.log"
    with open(log, "wb") as written:  # the server's own handle: the log is read while it runs
        process = subprocess.Popen([str(BIN_DIR / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                                   env=clean_env(), cwd=REPO_ROOT, stdout=written, stderr=written,
                                   start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(process, f"{endpoint}/moto-api/", "moto_server", timeout_s,
                           output=lambda: log.read_text(errors="replace"))
        forget_cached_s3_filesystems()
        try:
            yield S3Server(process, endpoint, log)
        except BaseException as failure:
            # A request refused because the server itself is gone reads like a client's fault: say it is not.
            if not still_serving(process, port):
                state = "still running" if process.poll() is None else f"exit code {process.returncode}"
                raise ServerDied(f"moto_server on {endpoint} stopped listening while in use ({state}; its log "
                                 f"ends: {log.read_text(errors='replace')[-1500:]!r})") from failure
            raise
    finally:
        forget_cached_s3_filesystems()
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        kill_session(process)
        process.wait(timeout=30)
        folder.cleanup()
