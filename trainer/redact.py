"""Credentials out of everything the trainer writes: logs, error lines, config.yaml, checkpoints, folder names.

A data or checkpoint URL may carry a password (``ftp://alice:secret@host/data``, also one holding "@", "/"
or "?"), a token as its user name (``https://TOKEN@host/repo``), a token in its query string
(``https://host/data?sig=...``, S3 and Azure pre-signed URLs) or in its fragment (``#access_token=...``).
The URL itself is used as given; only what is shown or stored is redacted: the password, a user name that
stands alone, every query value and every key=value of a fragment.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, NoReturn

__all__ = ["HIDDEN", "RedactingArgumentParser", "redact", "redacted"]

HIDDEN = "***"
# A URL ends before white space or quotes, and not with the punctuation of the sentence around it.
_URL = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^\s'\"<>]*[^\s'\"<>.,:;)])")
# Where the user information ends: the last "@" that a host name follows (then a port, a path, a query, a
# fragment or the end). A password may hold "@", "/" or "?" that its author did not percent-encode.
_LAST_AT = re.compile(r"@(?=[A-Za-z0-9._~%\[\]-]*(?::\d*)?(?:[/?#]|$))")
_KEY_VALUE = re.compile(r"([?&#][^=&#]+)=[^&#]*")


def _redact_url(match: re.Match[str]) -> str:
    scheme, rest = match.group(1), match.group(2)
    rest = _redact_user_information(rest)
    if "?" not in rest and "#" not in rest:
        return scheme + rest
    cut = min(position for position in (rest.find("?"), rest.find("#")) if position >= 0)
    # Every value of the query (pre-signed URLs' signatures, tokens) and of a fragment's key=value pairs
    # (OAuth's #access_token=...); a bare fragment (#section) names a place, not a secret.
    return scheme + rest[:cut] + _KEY_VALUE.sub(rf"\1={HIDDEN}", rest[cut:])


def _user_information(rest: str) -> tuple[str | None, str, int] | None:
    """A URL's (after its scheme) user, secret and where its "@" is: in ``user:password@`` the password is the
    secret; a user alone (``TOKEN@``, how GitHub and many services take a token) is the secret, with no user.
    Text before an "@" that holds a "/" and no ":" is a path with an "@" in it (``s3://bucket/logo@2x.png``),
    not credentials: None, as for no "@"."""
    at = None
    for found in _LAST_AT.finditer(rest):
        at = found.start()
    if at is None:
        return None
    credentials = rest[:at]
    if ":" in credentials:
        user, secret = credentials.split(":", 1)
        return user, secret, at
    if "/" in credentials or "?" in credentials or "#" in credentials:
        return None
    return None, credentials, at  # no user: the token alone


def _redact_user_information(rest: str) -> str:
    found = _user_information(rest)
    if found is None:
        return rest
    user, _, at = found
    return f"{HIDDEN}{rest[at:]}" if user is None else f"{user}:{HIDDEN}{rest[at:]}"


def redact(text: str, *urls: str) -> str:
    """``text`` with the credentials of each URL in it (see the module's docstring) replaced by ***; and, where
    ``urls`` are the addresses the text is about, their secrets wherever they appear without a scheme around them
    (a storage client's own message: ``Invalid bucket name "AKIA:SECRET@bucket"``)."""
    shown = _URL.sub(_redact_url, text) if "://" in text else text
    for url in urls:
        for secret in _secrets_of(url):
            shown = shown.replace(secret, HIDDEN)
    return shown


def _secrets_of(url: str) -> list[str]:
    """The password (or a user name standing alone: a token) in a URL's user information, and its query's and
    fragment's values."""
    scheme = _URL.match(url.strip())
    if scheme is None:
        return []
    rest = scheme.group(2)
    found = _user_information(rest)
    secrets = [found[1]] if found is not None else []
    secrets += [match.group(0).split("=", 1)[1] for match in _KEY_VALUE.finditer(rest)]
    return [secret for secret in secrets if len(secret) >= 3]  # never a fragment so short it hides other words


def redacted(value: Any) -> Any:
    """A copy of a config-like value (dicts, lists, strings) with every string redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redacted(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redacted(item) for item in value)
    return value


class RedactingArgumentParser(argparse.ArgumentParser):
    """argparse, whose own error lines echo what was typed (``unrecognized arguments: --datadir
    s3://AKIA:SECRET@bucket``, ``invalid choice: '...'``): an unrecognized argument is named by its flag alone,
    its values counted, not shown; any other echoed value has its URLs' credentials hidden."""

    def error(self, message: str) -> NoReturn:
        super().error(redact(_without_typed_values(message)))


def _flag_alone(word: str) -> str:
    """``--flag=value`` as ``--flag``, ``-pVALUE`` as ``-p``."""
    return word.split("=", 1)[0] if word.startswith("--") else word[:2]


def _without_typed_values(message: str) -> str:
    """argparse's messages that quote what was typed beside a flag, with the flag alone: an unknown argument's
    values (counted), an ambiguous abbreviation's ``=value``, a boolean flag's ignored ``=value``. A value a
    flag refused (``invalid int value: '...'``) stays, URL credentials hidden by the caller: it says what to fix."""
    unknown = "unrecognized arguments: "
    if message.startswith(unknown):
        words = message[len(unknown):].split()
        flags = [_flag_alone(word) for word in words if word.startswith("-")]
        hidden = sum(1 for word in words if not word.startswith("-") or _flag_alone(word) != word)
        return unknown + " ".join(flags) + (f" (and {hidden} value(s), not shown)" if hidden else "")
    ambiguous = re.match(r"ambiguous option: (\S+) could match (.*)$", message, re.DOTALL)
    if ambiguous:
        return f"ambiguous option: {_flag_alone(ambiguous.group(1))} could match {ambiguous.group(2)}"
    return re.sub(r"ignored explicit argument .*$", "ignored explicit argument (not shown)", message)
