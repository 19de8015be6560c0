"""Shared by every test.

Layout: unit/ runs in this process (fast; `make test-fast` with the deploy checks that need no
process); integration/ starts real ranks with real collectives (marked slow here, by folder);
deploy/ checks and runs the launchers' files (Compose, Kubernetes, TorchX); support/ holds the
helpers and workers/ the scripts that tests start as processes.

`make test` runs integration/ and deploy/ on two pytest-xdist workers, each test file whole on one worker
(its module fixtures, such as one reference run, are made once; the files on fixed ports all on one), then
unit/ and the files marked ``serial`` alone: they time their own threads or set limits of a few seconds that a
busy machine would miss.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
INTEGRATION = TESTS / "integration"
UNIT = TESTS / "unit"
# Fixtures shared by several folders: mount_point (tmpfs mounts for full and read-only disks), s3 and s3_env
# (a real S3-compatible server on loopback), s3_faults (a proxy in front of it that fails chosen requests), azure and
# azure_env (Azurite, a real Azure Blob Storage server on loopback).
pytest_plugins = ["tests.support.mounts", "tests.support.s3_server", "tests.support.s3_faults",
                  "tests.support.azure_server"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.slow)
        if item.path.is_relative_to(UNIT):  # in this process, many of them timing their own threads
            item.add_marker(pytest.mark.serial)


# optionalhook: pytest-xdist's hook; a machine without it (the GPU machine's pytest) runs the tests in one process.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile``, with every file on fixed ports in one unit of work (``on_fixed_ports``). (xdist's own
    ``xdist_group`` marks are lost under pytest 9, whose node ids xdist can no longer rename.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndFixedPorts(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "fixed-ports" if on_fixed_ports(Path(path)) else path

    return FilesAndFixedPorts(config, log)


def on_fixed_ports(path: Path) -> bool:
    """Files whose jobs listen on fixed ports of this machine: Kubernetes jobs run as processes (each pod on a
    loopback address 127.0.1.N and its manifest's ports: tests/support/k8s_processes.py), and TorchX's local jobs
    (c10d on port 29500). No two of them may run at once, so one worker runs them all, in turn."""
    return path.name.startswith("test_k8s_") or path.name == "test_torchx.py"
