"""How an object store's client is opened where its own retries must be bounded: the caller retries itself, with
backoff it chooses, so that a store that is away costs a bounded pause per request (botocore's defaults plus s3fs's
own loop retried one throttled request for 47 s, measured through tests/support/s3_faults.py; azure-storage-blob's
defaults, 3 retries 15, 18 and 24 s apart with connect and read timeouts of 20 and 60 s, held a save to an Azurite
that had gone away for over 2 minutes, tests/integration/test_checkpoint_azure_faults.py).

The one place that reaches into another project's internals for it: adlfs takes no retry options and hands none to
the azure client it makes, so its client's retry policy and transport are set once made (azure-storage-blob 12.x:
every container and blob client adlfs derives from the service client shares that policy and transport)."""

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


# azure-storage-blob's ExponentialRetry waits initial + base ** retry (retry 1, 2, ...), give or take the jitter: 1.5
# then 2.25 s here, about botocore's; 15 + 3, 15 + 9 s by default.
AZURE_BACKOFF_BASE_S = 1.5
AZURE_BACKOFF_JITTER_S = 0.5


def without_own_retries(fs: Any, attempts: int, request_timeout_s: float) -> Any:
    """The client's own retries bounded: s3fs retries throttled requests 5 times by itself, each up to the
    timeout, around botocore's: once only. adlfs's azure client: ``attempts`` per request (connection refused,
    reset, timed out, a 5xx), a few seconds apart, each connect and read within the timeouts S3's have."""
    if hasattr(fs, "retries"):
        fs.retries = 1
    config = getattr(getattr(fs, "service_client", None), "_config", None)  # adlfs's AzureBlobFileSystem
    policy, transport = getattr(config, "retry_policy", None), getattr(config, "transport", None)
    if policy is not None and hasattr(policy, "total_retries"):
        retries = attempts - 1
        policy.total_retries = policy.connect_retries = policy.read_retries = policy.status_retries = retries
        policy.initial_backoff, policy.increment_base = 0, AZURE_BACKOFF_BASE_S
        policy.random_jitter_range = AZURE_BACKOFF_JITTER_S
    connection = getattr(transport, "connection_config", None)
    if connection is not None:
        connection.timeout, connection.read_timeout = min(10.0, request_timeout_s), request_timeout_s
    return fs
