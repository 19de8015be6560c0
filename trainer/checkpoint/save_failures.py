"""Which checkpoint failures a retry may fix, and what a failed save tells every rank.

A periodic save is not the training: one that fails on a storage hiccup (an I/O error, a 5xx or throttling that
outlived the client's retries, a dropped connection, a lease that could not be read) costs at most the work since
the last committed checkpoint, never the job. Errors that a retry cannot fix (no permission, no such bucket or
folder, a full disk, a folder another job holds, a state that cannot be serialised) stay errors of the input:
exit 2, fix it.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from trainer.errors import CheckpointError, StorageUnavailable

# OSErrors a retry does not fix: the folder's permissions, its existence, the space left.
PERMANENT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR,
                              errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG, errno.EEXIST, errno.EINVAL})
# The packages whose own errors (not OSErrors) are a storage client's: botocore's ClientError and connection
# errors, aiohttp's, urllib3's, the cloud SDKs'.
STORAGE_CLIENT_PACKAGES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "s3fs", "gcsfs", "adlfs",
                           "azure", "google", "fsspec")
# An object store's error codes that no retry fixes (S3's; GCS and Azure answer through the same statuses).
PERMANENT_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                             "NoSuchBucket", "InvalidBucketName", "AccountProblem", "ExpiredToken",
                             "InvalidToken", "403", "404"})
# A storage client's errors of configuration, which no retry fixes (botocore's: no credentials, no region).
PERMANENT_TYPE_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError", "NoRegionError",
                                  "ParamValidationError", "ProfileNotFound", "InvalidRegionError",
                                  "UnknownServiceError", "InvalidConfigError"})
# The type names an error relayed from another rank may carry (trainer.checkpoint.dcp_errors.Relayed holds the
# type's name and words only): those of the client errors above a retry may fix.
TRANSIENT_TYPE_NAMES = frozenset({"ClientError", "ConnectionError", "EndpointConnectionError", "ConnectTimeoutError",
                                  "ReadTimeoutError", "ConnectionClosedError", "ResponseStreamingError",
                                  "ServerDisconnectedError", "ClientOSError", "ClientPayloadError",
                                  "ClientConnectorError", "IncompleteReadError", "ProtocolError", "TimeoutError"})


@dataclass(frozen=True)
class SaveFailure:
    """A save that did not commit, as rank 0 tells every rank: its message, and whether a retry may fix it."""

    message: str
    transient: bool
    stalled: bool = False  # outlasted --checkpoint-timeout-s: the storage stopped answering (StorageStalled)


def is_transient(error: BaseException) -> bool:
    """Whether a retry of the save may succeed where this error stopped it."""
    if isinstance(error, StorageUnavailable):  # said so where it was raised (the storage, the lease's check)
        return True
    if isinstance(error, CheckpointError):  # a lost lease, a refused commit, a checkpoint that cannot be made
        return False
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno not in PERMANENT_ERRNOS
    if isinstance(error, PermissionError | FileNotFoundError | NotADirectoryError | IsADirectoryError):
        return False
    code = _error_code(error)
    if code is not None:
        return code not in PERMANENT_CODES
    if isinstance(error, OSError):  # no errno: a client's connection error (aiohttp's ClientOSError, a timeout)
        return True
    if type(error).__name__ in PERMANENT_TYPE_NAMES:
        return False
    return type(error).__module__.split(".")[0] in STORAGE_CLIENT_PACKAGES


def is_transient_type_name(name: str) -> bool:
    """For an error known by its type's name only (relayed from another rank)."""
    return name in TRANSIENT_TYPE_NAMES


def _error_code(error: BaseException) -> str | None:
    """An object store client's error code (botocore's ClientError: ``response["Error"]["Code"]``), if any."""
    response = getattr(error, "response", None)
    if not isinstance(response, dict):
        return None
    details = response.get("Error")
    code = details.get("Code") if isinstance(details, dict) else None
    return str(code) if code is not None else None
