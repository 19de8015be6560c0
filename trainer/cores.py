"""How many cores this process may use: its CPU affinity, and a container's CPU limit where one is set.

A pod with ``cpu: 2`` on a 64-core node sees all 64 cores in its affinity; its cgroup's quota is what the
kernel lets it run. Threads and DataLoader workers sized by the affinity alone would be throttled.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["usable_cores"]

CGROUP = Path("/sys/fs/cgroup")


def usable_cores(cgroup: Path | None = None) -> int:
    """The affinity's cores, at most the CPU limit of the cgroup mounted at /sys/fs/cgroup (``cgroup``): v2's
    ``cpu.max``, v1's CFS quota. Inside a container that is the container's own; a process in a nested cgroup of
    a host (a systemd slice with CPUQuota) is not limited here, only by its affinity."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = _cgroup_limit(cgroup or CGROUP)
    return max(1, min(cores, limit)) if limit is not None else max(1, cores)


def _cgroup_limit(cgroup: Path) -> int | None:
    """The quota in whole cores (rounded up), or None where no limit is set or none can be read."""
    try:
        fields = (cgroup / "cpu.max").read_text().split()  # v2: "QUOTA PERIOD", "max PERIOD" when unlimited
        quota, period = (fields[0], fields[1]) if len(fields) == 2 else ("max", "1")
    except OSError:
        try:  # v1: -1 when unlimited
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max"
        return None
    return math.ceil(quota_us / period_us) if quota_us > 0 and period_us > 0 else None
