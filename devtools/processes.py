"""Starting the trainer, its tools and worker scripts as real processes, for the tests and the benchmarks.

Every process gets this environment less any launcher variable (a test run under torchrun must not
hand its rank down), one thread (the machines have few cores and the tests start several ranks), the
repository on PYTHONPATH and this venv's tools (torchrun, torchx, ddp-train, kubectl) first on PATH.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from trainer.launchers import without_launcher_variables

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN_DIR = Path(sys.executable).parent  # torchrun, torchx, ddp-train and kubectl of the same venv
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
DDP_TORCHRUN = [sys.executable, "-m", "trainer.elastic_agent"]  # ddp-torchrun, for elastic jobs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launcher variables, one thread, the repository importable."""
    env = without_launcher_variables(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env["PATH"] = os.pathsep.join(filter(None, [str(BIN_DIR), env.get("PATH", "")]))
    env.update(extra or {})
    return env


def run(cmd: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = 300,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command to completion, output captured; a hang raises TimeoutExpired instead of blocking.

    The command gets a session of its own, and whatever is left of it when it ends or times out is killed:
    a launcher killed on a timeout would otherwise leave its ranks (and their DataLoader workers) running.
    """
    process = subprocess.Popen(list(cmd), env=clean_env(env), cwd=cwd or REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as timeout:
        kill_session(process)
        out, err = process.communicate()
        raise subprocess.TimeoutExpired(process.args, timeout_s, out, err) from timeout
    finally:
        kill_session(process)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def kill_session(process: subprocess.Popen[str]) -> None:
    """SIGKILL to every process left in the session that ``process`` leads (it may be gone already)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, parents first, read from /proc (Linux). torchrun starts its workers in
    sessions of their own, so killing an agent's session leaves them: a node lost is the whole tree."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        current = queue.pop(0)
        found.append(current)
        queue.extend(children.get(current, []))
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL to ``pid`` and every process below it (what losing a node does to them), each that is still there."""
    for member in descendants(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)


def marked(mark: str) -> list[int]:
    """Every process whose environment holds ``DDP_DEVTOOLS_MARK=mark``: what a test started and all that those
    started, also the ones left to init when their parent died (which a tree misses)."""
    wanted = f"DDP_DEVTOOLS_MARK={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if wanted in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


def kill_marked(mark: str) -> None:
    """SIGKILL to every marked process (``marked``)."""
    for pid in marked(mark):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def python_stacks(pids: Sequence[int]) -> str:
    """Each process's Python stacks, by py-spy (the dev extra's, beside this interpreter): where a hung test's
    processes were, for its failure message. Empty where py-spy is missing."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.is_file():
        return ""
    dumps = []
    for pid in pids:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            dumped = subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True,
                                    timeout=30, check=False)
            dumps.append(f"--- py-spy dump --pid {pid}\n{dumped.stdout}{dumped.stderr}")
    return "\n".join(dumps)


def wait_until_answers(process: subprocess.Popen, url: str, what: str, timeout_s: float,
                       output: Callable[[], str] = lambda: "") -> None:
    """Until ``url`` answers an HTTP GET: a server started as ``process`` is ready. Fails if it exits first
    (with ``output()``, its log) or stays silent past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, f"{what} exited with {process.returncode}: {output()[-2000:]}"
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"{what} did not answer on {url} in {timeout_s:g}s"
            time.sleep(0.1)


def torchrun_command(nproc: int, module: str, args: Sequence[str], extra_torchrun: Sequence[str] = ()
                     ) -> list[str]:
    """torchrun --standalone (a rendezvous on a free local port: parallel runs never collide) of a module."""
    return [*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *extra_torchrun, "-m", module, *args]


def torchrun(script_args: Sequence[str], nproc: int, env: Mapping[str, str] | None = None,
             module: str = "trainer", timeout_s: float = 300, extra_torchrun: Sequence[str] = ()
             ) -> subprocess.CompletedProcess[str]:
    """nproc local ranks of ``python -m module script_args`` under torchrun, run to completion."""
    return run(torchrun_command(nproc, module, script_args, extra_torchrun), env=env, timeout_s=timeout_s)


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
    try:
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {rank} did not finish within {timeout_s}s") from None
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:  # a failing test must not leave ranks behind
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results
