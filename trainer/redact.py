"""Credentials out of everything the trainer writes: logs, error lines, config.yaml, checkpoints, folder names.

A data or checkpoint URL may carry a password (``ftp://alice:secret@host/data``) or a token in its query
string (``https://host/data?sig=...``, S3 and Azure pre-signed URLs). The URL itself is used as given;
only what is shown or stored is redacted: the password, and every query value.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["HIDDEN", "redact", "redacted"]

HIDDEN = "***"
# A URL ends before white space or quotes, and not with the punctuation of the sentence around it.
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]*[^\s'\"<>.,:;)]")
_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/?#@:]*):[^/?#@]*@")
_QUERY_VALUE = re.compile(r"([?&][^=&#]+)=[^&#]*")


def _redact_url(match: re.Match[str]) -> str:
    url = _PASSWORD.sub(rf"\1:{HIDDEN}@", match.group(0))
    if "?" not in url:
        return url
    head, query = url.split("?", 1)
    return head + _QUERY_VALUE.sub(rf"\1={HIDDEN}", "?" + query)


def redact(text: str) -> str:
    """``text`` with the password and the query values of each URL in it replaced by ***."""
    return _URL.sub(_redact_url, text) if "://" in text else text


def redacted(value: Any) -> Any:
    """A copy of a config-like value (dicts, lists, strings) with every string redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redacted(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redacted(item) for item in value)
    return value
