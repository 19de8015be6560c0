"""What a test does when the machine lacks something it needs (root, Docker, an image, a Debian package).

On a developer's machine it skips, saying what is missing. Under CI=true it fails with the same reason:
.ci/run provides every precondition, so a missing one there is a broken set-up, not a reason to pass.
"""

from __future__ import annotations

import os

import pytest


def unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; .ci/run provides it (CI=true: a missing precondition fails the test)")
    pytest.skip(reason)
