"""The S3-compatible server's fixtures (devtools.s3_server): one server for the session, a bucket per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devtools.s3_server import S3Server, s3_server

__all__ = ["S3Server", "s3", "s3_env"]


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """One S3 server for the session; each test takes a bucket of its own (``s3.new_bucket()``)."""
    with s3_server() as server:
        yield server


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, reachable from this process's s3fs too."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    return s3
