"""Small tmpfs mounts for the tests of full and read-only disks (root only; elsewhere they skip, under
CI=true they fail)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.preconditions import unavailable


@pytest.fixture
def mount_point(tmp_path: Path) -> Iterator[Path]:
    """An empty folder to mount a tmpfs on (mount_tmpfs); unmounted at the end."""
    point = tmp_path / "mnt"
    point.mkdir()
    yield point
    unmount(point)


def mount_tmpfs(options: str, point: Path) -> None:
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        unavailable(f"cannot mount a tmpfs here (needs root and mount permission): {done.stderr.strip()}")


def unmount(point: Path) -> None:
    subprocess.run(["umount", str(point)], capture_output=True, check=False)
