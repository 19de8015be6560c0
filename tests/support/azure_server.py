"""The Azure Blob Storage server's fixtures (devtools.azurite): one server for the session, a container per test."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from adlfs import AzureBlobFileSystem

from devtools.azurite import AzureServer, azure_server
from devtools.tcp_gate import TcpGate, tcp_gate

__all__ = ["AzureServer", "TcpGate", "azure", "azure_env", "azure_gate"]


@pytest.fixture(scope="session")
def azure() -> Iterator[AzureServer]:
    """One Azurite for the session; each test takes a container of its own (``azure.new_container()``)."""
    with azure_server() as server:
        yield server


@pytest.fixture
def azure_env(azure: AzureServer, monkeypatch: pytest.MonkeyPatch) -> AzureServer:
    """The server, reachable from this process's adlfs too."""
    for name, value in azure.env.items():
        monkeypatch.setenv(name, value)
    # adlfs reads its credentials from the environment when an instance is made, and fsspec hands out an instance it
    # keeps for the same arguments: one made without them (another test's) would try the cloud's identity, which
    # goes off this machine (the instance metadata address) instead of to this server.
    AzureBlobFileSystem.clear_instance_cache()
    return azure


@pytest.fixture
def azure_gate(azure: AzureServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TcpGate, AzureServer]]:
    """The server behind a port a test closes and opens again (devtools.tcp_gate), and the server as reached
    through it, in this process's environment too: an endpoint that vanishes and comes back with its blobs."""
    from adlfs import AzureBlobFileSystem

    # fsspec keeps a file system per set of options, and the endpoint is in the environment, not among them: a
    # test's client would otherwise be the one an earlier test made for its own gate's port.
    AzureBlobFileSystem.clear_instance_cache()
    address = urlsplit(azure.endpoint)
    with tcp_gate((address.hostname or "127.0.0.1", address.port or 80)) as gate:
        through = dataclasses.replace(azure, endpoint=f"http://127.0.0.1:{gate.port}{address.path}")
        for name, value in through.env.items():
            monkeypatch.setenv(name, value)
        yield gate, through
    AzureBlobFileSystem.clear_instance_cache()
