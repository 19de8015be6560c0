"""A real Azure Blob Storage server on loopback for the tests: Microsoft's emulator Azurite (the npm package
``azurite``, which `make azurite` installs into the venv's folder), the trainer reaching it through adlfs as it would
reach a storage account (a connection string in the environment, ``az://container/...`` URLs)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from devtools.processes import BIN_DIR, clean_env, free_port, kill_session

AZURITE = BIN_DIR.parent / "azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's development account: the name and key its documentation publishes, the same in every copy (no secret).
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@dataclass
class AzureServer:
    process: subprocess.Popen[bytes]
    endpoint: str  # the account's blob endpoint

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
                f"BlobEndpoint={self.endpoint};")

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach this server with adlfs (it reads the connection string from there)."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def new_container(self) -> str:
        """A fresh, empty container (its name)."""
        from azure.storage.blob import BlobServiceClient

        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        with BlobServiceClient.from_connection_string(self.connection_string) as client:
            client.create_container(name)
        return name


@contextlib.contextmanager
def azure_server(timeout_s: float = 60) -> Iterator[AzureServer]:
    if not AZURITE.exists():
        raise RuntimeError(f"Azurite is not installed at {AZURITE}: run `make azurite` (it needs npm; .ci/run "
                           f"installs Node.js and npm from Debian)")
    port = free_port()
    folder = tempfile.TemporaryDirectory(prefix="azurite-")
    log = Path(folder.name) / "azurite.log"
    with open(log, "wb") as written:
        # In memory, nothing written to the working folder; no telemetry (the tests reach nothing outside); an API
        # version check skipped, since the Python SDK may speak a newer version than this Azurite knows.
        process = subprocess.Popen(
            [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
             "--disableTelemetry", "--skipApiVersionCheck"],
            env=clean_env(), cwd=folder.name, stdout=written, stderr=written, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:  # Azurite answers no unsigned GET with a success: its port accepting is the sign
            assert process.poll() is None, \
                f"azurite exited with {process.returncode}: {log.read_text(errors='replace')[-2000:]}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"azurite did not listen on port {port} in {timeout_s:g}s"
                time.sleep(0.1)
        yield AzureServer(process, f"http://127.0.0.1:{port}/{ACCOUNT}")
    finally:
        kill_session(process)
        process.wait(timeout=30)
        folder.cleanup()
