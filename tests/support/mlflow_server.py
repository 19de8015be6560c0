"""A real MLflow tracking server on loopback for the tests: ``mlflow server`` over SQLite, its artifacts in a
folder (served through the server, as a team's server keeps them in a bucket), read back with MLflow's own
client."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from devtools.processes import BIN_DIR, REPO_ROOT, clean_env, free_port, kill_session, wait_until_answers


@dataclass
class MlflowServer:
    process: subprocess.Popen[bytes]
    uri: str
    folder: Path

    def client(self):  # noqa: ANN201 - mlflow.MlflowClient, imported late (an extra)
        from mlflow import MlflowClient

        return MlflowClient(self.uri)

    @contextlib.contextmanager
    def hung(self) -> Iterator[None]:
        """Frozen (SIGSTOP) within: it accepts connections and answers nothing, as a server that hangs."""
        os.killpg(self.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """Gone mid-run, as a server whose pod or machine is lost."""
        kill_session(self.process)
        self.process.wait(timeout=30)


@contextlib.contextmanager
def mlflow_server(folder: Path, timeout_s: float = 180) -> Iterator[MlflowServer]:
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    log = open(folder / "server.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen([str(BIN_DIR / "mlflow"), "server",
                                "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
                                "--artifacts-destination", str(folder / "artifacts"),
                                "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                               env=clean_env(), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(process, f"{uri}/health", "mlflow server", timeout_s,
                           lambda: (folder / "server.log").read_text())
        yield MlflowServer(process, uri, folder)
    finally:
        kill_session(process)
        process.wait(timeout=30)
        log.close()
