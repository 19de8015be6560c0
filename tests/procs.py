"""Starting real trainer processes from tests: torchrun, plain env launches, and the environment they need."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
LAUNCHER_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "NODE_RANK",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test runner's environment without any launcher variables, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("PET_")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def run(cmd: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = 300,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command to completion, output captured; a hang fails the test instead of blocking it."""
    return subprocess.run(list(cmd), env=clean_env(env), cwd=cwd or REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def torchrun(script_args: Sequence[str], nproc: int, env: Mapping[str, str] | None = None,
             module: str = "trainer", timeout_s: float = 300, extra_torchrun: Sequence[str] = ()
             ) -> subprocess.CompletedProcess[str]:
    """torchrun --standalone with nproc local ranks running ``python -m module script_args``."""
    cmd = [*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *extra_torchrun, "-m", module, *script_args]
    return run(cmd, env=env, timeout_s=timeout_s)


def env_ranks(script_args: Sequence[str], world_size: int, env: Mapping[str, str] | None = None,
              module: str = "trainer", timeout_s: float = 300) -> list[subprocess.CompletedProcess[str]]:
    """Start world_size plain processes with RANK/WORLD_SIZE/MASTER_* (the Compose and PyTorchJob style)."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = clean_env({**(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        procs.append(subprocess.Popen([sys.executable, "-m", module, *script_args], env=rank_env, cwd=REPO_ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise AssertionError(f"rank {rank} did not finish within {timeout_s}s") from None
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results
