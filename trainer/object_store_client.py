"""How an object store's client is opened where its own retries must be bounded: the caller retries itself, with
backoff it chooses, so that a store that is away costs a bounded pause per request (botocore's defaults plus s3fs's
own loop retried one throttled request for 47 s, measured through tests/support/s3_faults.py)."""

from __future__ import annotations

from typing import Any

S3_PROTOCOLS = ("s3", "s3a")


def bounded_options(protocol: str, attempts: int, request_timeout_s: float) -> dict[str, Any]:
    """fsspec options for ``protocol``: for S3, botocore's connect and read timeouts and its attempts per request
    ("total_max_attempts" counts the first; botocore's "max_attempts" 1 would mean one retry more)."""
    if protocol not in S3_PROTOCOLS:
        return {}
    return {"config_kwargs": {"connect_timeout": min(10.0, request_timeout_s), "read_timeout": request_timeout_s,
                              "retries": {"total_max_attempts": attempts}}}


def without_own_retries(fs: Any) -> Any:
    """s3fs retries throttled requests 5 times by itself, each up to the timeout, around botocore's: once only."""
    if hasattr(fs, "retries"):
        fs.retries = 1
    return fs
