"""The fault proxy's fixture (devtools.s3_faults): a proxy per test in front of the session's S3 server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devtools.s3_faults import FaultProxy, s3_fault_proxy
from devtools.s3_server import S3Server

__all__ = ["FaultProxy", "s3_faults"]


@pytest.fixture
def s3_faults(s3: S3Server) -> Iterator[FaultProxy]:
    """A proxy in front of the session's S3 server that fails the requests a test chooses (``s3_faults.fail``);
    ``s3_faults.env`` is what a trainer process needs to reach the server through it. Buckets: ``s3.new_bucket()``."""
    with s3_fault_proxy(s3) as proxy:
        yield proxy
