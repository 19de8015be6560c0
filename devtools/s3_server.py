"""A real S3-compatible server on loopback for the tests and the bench: moto's standalone server
(``moto_server``), the trainer reaching it through s3fs as it would reach AWS or MinIO (``AWS_ENDPOINT_URL`` and
credentials in the environment, ``s3://bucket/...`` URLs)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.processes import BIN_DIR, REPO_ROOT, clean_env, free_port, kill_session, wait_until_answers


@dataclass
class S3Server:
    process: subprocess.Popen[bytes]
    endpoint: str
    recording: Path  # where moto's recorder writes the requests it answers while recording (``recorded``)

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
    def recorded(self) -> Iterator[list[dict[str, Any]]]:
        """The requests the server answers meanwhile, each its method, URL and headers (moto's recorder, which
        the server runs with recording off until asked), filled in once the block ends."""
        answered: list[dict[str, Any]] = []
        for action in ("reset-recording", "start-recording"):
            urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/recorder/{action}",
                                                          method="POST"), timeout=30).close()
        try:
            yield answered
        finally:
            urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/recorder/stop-recording",
                                                          method="POST"), timeout=30).close()
            with self.recording.open() as lines:
                answered.extend({key: entry[key] for key in ("method", "url", "headers")}
                                for entry in map(json.loads, lines))

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
    recording = Path(tempfile.mkdtemp(prefix="moto-recording-")) / "requests.jsonl"
    process = subprocess.Popen([str(BIN_DIR / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                               env=clean_env({"MOTO_RECORDER_FILEPATH": str(recording)}), cwd=REPO_ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(process, f"{endpoint}/moto-api/", "moto_server", timeout_s)
        yield S3Server(process, endpoint, recording)
    finally:
        shutil.rmtree(recording.parent, ignore_errors=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        kill_session(process)
        process.wait(timeout=30)
