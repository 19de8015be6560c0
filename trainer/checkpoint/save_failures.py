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

# OSErrors a retry does not fix: the folder's permissions, its existence, the space left, a path that cannot be.
PERMANENT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR,
                              errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.ENAMETOOLONG, errno.ELOOP, errno.EEXIST,
                              errno.EINVAL})
# An object store's error codes (S3's, as botocore's ClientError carries them, and as s3fs keeps them as the cause
# of the OSError it raises: its EINVAL for a BadDigest is a retry's business, its EINVAL for InvalidBucketName not).
TRANSIENT_CODES = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "IncompleteBody",
                             "BadDigest", "InvalidPart", "OperationAborted", "Throttling", "ThrottlingException",
                             "RequestLimitExceeded", "TokenRefreshRequired", "500", "502", "503", "504", "429"})
# Errors without an errno or a code: transient only where their type (or a base of it) is a connection's or a
# timeout's, as botocore, aiohttp and urllib3 name them. Anything else (a 403 as gcsfs raises it, missing
# credentials, azure's ClientAuthenticationError) is no storage hiccup: a retry would fail the same way.
TRANSIENT_TYPE_NAMES = frozenset({"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                                  "ConnectionClosedError", "ResponseStreamingError", "IncompleteReadError",
                                  "ServerDisconnectedError", "ClientOSError", "ClientPayloadError",
                                  "ClientConnectorError", "ClientConnectionError", "ServerTimeoutError",
                                  "ProtocolError", "NewConnectionError", "ServiceRequestError",
                                  "ServiceResponseError", "TransportError", "ConnectionError", "TimeoutError"})
# Types a client wraps another error in without saying more (adlfs: RuntimeError for a failed upload or removal,
# ValueError for a container it could not check or create): the error they wrap decides. A specific type
# (PermissionError, FileNotFoundError, FileExistsError, even without an errno) decides itself.
GENERIC_WRAPPERS = frozenset({Exception, RuntimeError, ValueError, OSError})
CHAIN_DEPTH = 8  # links of __cause__/__context__ looked at: a chain is a few wrappers long, never a loop walked forever


@dataclass(frozen=True)
class SaveFailure:
    """A save that did not commit, as rank 0 tells every rank: its message, and whether a retry may fix it."""

    message: str
    transient: bool
    stalled: bool = False  # outlasted --checkpoint-timeout-s: the storage stopped answering (StorageStalled)
    peer_lost: bool = False  # the ranks could not exchange the save's reports: a rank gone (PeerLost, exit 200)

    @classmethod
    def of(cls, error: CheckpointError) -> SaveFailure:
        """A CheckpointError as every rank is told of it: its words, and whether a retry may fix it."""
        return cls(str(error), is_transient(error))

    def error(self, message: str | None = None) -> CheckpointError:
        """The error to raise for it: StorageUnavailable (exit 200) where a retry may fix it, else CheckpointError
        (exit 2). ``message``: other words than its own (another rank's view of it)."""
        return (StorageUnavailable if self.transient else CheckpointError)(self.message if message is None else message)


def is_transient(error: BaseException) -> bool:
    """Whether a retry of the save may succeed where this error stopped it: the outermost error that says so either
    way decides; a generic wrapper (adlfs's ``RuntimeError("Failed to upload block: ...") from e``, an OSError
    without an errno) says nothing of itself, and the error it wraps decides."""
    link: BaseException | None = error
    for _ in range(CHAIN_DEPTH):
        if link is None:
            break
        verdict = _verdict(link)
        if verdict is not None:
            return verdict
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    return False


def _verdict(error: BaseException) -> bool | None:
    """Whether a retry may fix this error, judged by itself (and its client's code or status on its cause); None
    where it is a generic wrapper that tells nothing."""
    if isinstance(error, StorageUnavailable):  # said so where it was raised (the storage, the lease's check)
        return True
    if isinstance(error, CheckpointError):  # a lost lease, a refused commit, a checkpoint that cannot be made
        return False
    said = getattr(error, "transient", None)
    if isinstance(said, bool):  # decided on the rank that failed, before DCP relayed it (dcp_errors.plain)
        return said
    code = _error_code(error) or _error_code(error.__cause__)
    if code in TRANSIENT_CODES:
        return True
    # Another store's own code (MinIO's SlowDownWrite, 503): its HTTP status tells. botocore keeps it in the response,
    # gcsfs and azure on the error (azure-core's HttpResponseError: 403 AuthorizationFailure, 404 ContainerNotFound,
    # 409 BlobAlreadyExists are no hiccups; 500 OperationTimedOut, 503 ServerBusy are).
    status = _status(error) or _status(error.__cause__)
    if status is not None:
        return status >= 500 or status in (408, 429)
    if code is not None:
        return False
    if isinstance(error, ConnectionError | TimeoutError):
        return True
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno not in PERMANENT_ERRNOS
    if any(kind.__name__ in TRANSIENT_TYPE_NAMES for kind in type(error).__mro__):
        return True
    return None if type(error) in GENERIC_WRAPPERS else False


def _error_code(error: BaseException | None) -> str | None:
    """An object store client's error code (botocore's ClientError: ``response["Error"]["Code"]``), if any."""
    response = getattr(error, "response", None)
    if not isinstance(response, dict):
        return None
    details = response.get("Error")
    code = details.get("Code") if isinstance(details, dict) else None
    return str(code) if code is not None else None


def _status(error: BaseException | None) -> int | None:
    """The HTTP status of a store's answer, where the error keeps it: botocore's response metadata, gcsfs's
    ``code``, azure's ``status_code``, aiohttp's ``status``."""
    response = getattr(error, "response", None)
    if isinstance(response, dict) and isinstance(response.get("ResponseMetadata"), dict):
        value = response["ResponseMetadata"].get("HTTPStatusCode")
        if isinstance(value, int):
            return value
    for name in ("status", "status_code", "code"):
        value = getattr(error, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None
