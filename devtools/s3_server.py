"""A real S3-compatible server on loopback for the tests and the bench: moto's standalone server
(``moto_server``), the trainer reaching it through s3fs as it would reach AWS or MinIO (``AWS_ENDPOINT_URL`` and
credentials in the environment, ``s3://bucket/...`` URLs)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from devtools.processes import BIN_DIR, REPO_ROOT, clean_env, free_port, kill_session, wait_until_answers


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
        wait_until_answers(process, f"{endpoint}/moto-api/", "moto_server", timeout_s)
        yield S3Server(process, endpoint, log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        kill_session(process)
        process.wait(timeout=30)
        folder.cleanup()
