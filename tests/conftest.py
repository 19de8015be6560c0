"""Shared by every test.

Layout: unit/ runs in this process (fast; `make test-fast` with the deploy checks that need no
process); integration/ starts real ranks with real collectives (marked slow here, by folder);
deploy/ checks and runs the launchers' files (Compose, Kubernetes, TorchX); support/ holds the
helpers and workers/ the scripts that tests start as processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

INTEGRATION = Path(__file__).resolve().parent / "integration"
# Fixtures shared by several folders: mount_point (tmpfs mounts for full and read-only disks), s3 and s3_env
# (a real S3-compatible server on loopback), s3_faults (a proxy in front of it that fails chosen requests), azure and
# azure_env (Azurite, a real Azure Blob Storage server on loopback).
pytest_plugins = ["tests.support.mounts", "tests.support.s3_server", "tests.support.s3_faults",
                  "tests.support.azure_server"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.slow)
