"""Small tmpfs mounts for the tests of full and read-only disks (root only; elsewhere they skip, under
CI=true they fail)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.preconditions import unavailable


def mount_tmpfs(options: str, point: Path) -> None:
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        unavailable(f"cannot mount a tmpfs here (needs root and mount permission): {done.stderr.strip()}")


def unmount(point: Path) -> None:
    subprocess.run(["umount", str(point)], capture_output=True, check=False)
