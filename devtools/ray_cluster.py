"""A real Ray cluster on this machine, for the tests and the benchmark: a head and worker "nodes" started with
``ray start`` on loopback, each node's processes (its raylet and the workers it starts) marked so that one node
can be lost at once (SIGKILL, as a machine that dies) and the whole cluster stopped without ``ray stop``, which
would end every Ray cluster of the machine.

The head has no CPUs: the trainer's workers run on the worker nodes, one CPU each, so a node lost is a worker
lost. Its health checks are quick (a second, three misses), so a lost node is known dead within seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from devtools.processes import BIN_DIR, clean_env, descendants, free_port, marked

# A dead node is declared so after 3 missed checks a second apart (Ray's defaults: 5 of 3 s, after a 5 s delay).
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                      "health_check_failure_threshold": 3}


# Whatever this machine's user has set up for Ray: a token in ~/.ray/auth_token (which a local ray.init() writes)
# turns a head started without RAY_AUTH_MODE into a token cluster that the other nodes then fail to join.
ISOLATED = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


class RayCluster:
    """``with RayCluster() as cluster: cluster.add_node("a")``; ``cluster.address`` is the GCS address."""

    def __init__(self, cpus_per_node: int = 1, dashboard: bool = False) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.cpus_per_node = cpus_per_node
        # The head's dashboard, and in it the job server that `ray job submit` talks to (ray[default]).
        self.dashboard_port = free_port() if dashboard else None
        # Short: Ray's sockets live under it, and a socket path may be at most 107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ddpray-", dir="/tmp"))
        self.mark = f"ray-{self.port}"
        self.nodes: dict[str, str] = {}  # name -> its processes' mark

    def __enter__(self) -> RayCluster:
        try:
            dashboard = (["--include-dashboard=true", "--dashboard-host=127.0.0.1",
                          f"--dashboard-port={self.dashboard_port}"] if self.dashboard_port else
                         ["--include-dashboard=false"])
            self._ray_start("head", ["--head", f"--port={self.port}", "--num-cpus=0", *dashboard,
                                     "--disable-usage-stats", f"--temp-dir={self.temp_dir}",
                                     f"--system-config={json.dumps(FAST_HEALTH_CHECKS)}"])
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self) -> dict[str, str]:
        """What a driver needs to reach this cluster (and nothing of another)."""
        return {"RAY_ADDRESS": self.address, **ISOLATED}

    @property
    def dashboard_address(self) -> str:
        """The job server's address, for ``ray job submit --address`` (RAY_API_SERVER_ADDRESS)."""
        assert self.dashboard_port, "RayCluster(dashboard=True) has the job server"
        return f"http://127.0.0.1:{self.dashboard_port}"

    def add_node(self, name: str, hidden: Path | None = None) -> None:
        """A worker node of ``cpus_per_node`` CPUs; returns once it is up. ``hidden``: a folder this node sees
        empty (a tmpfs over it, in a mount namespace of the node's own): a folder the other nodes share and it
        does not, as a node without the shared mount (root only)."""
        self._ray_start(name, [f"--address={self.address}", f"--num-cpus={self.cpus_per_node}"], hidden)

    def lose_node(self, name: str) -> None:
        """The node and every process it started, killed at once: a machine that dies."""
        _kill(_processes(self.nodes.pop(name)))

    def node_id(self, name: str) -> str:
        """The node's id as Ray names it (hex): from its raylet's command line, which ``ray start`` gives it."""
        for pid in marked(self.nodes[name]):
            with contextlib.suppress(OSError):
                for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                    if arg.startswith(b"--node_id="):
                        return arg.partition(b"=")[2].decode()
        raise RuntimeError(f"node {name}: no raylet with a --node_id among its processes")

    def drain_node(self, name: str, deadline_s: int) -> None:
        """``ray drain-node`` as a cloud's reclaim of a spot instance asks for one: for preemption, the node gone in
        ``deadline_s``. Ray only marks it draining (nothing new is placed there); it stays up until lost."""
        result = subprocess.run([str(BIN_DIR / "ray"), "drain-node", f"--address={self.address}",
                                 f"--node-id={self.node_id(name)}", "--reason=DRAIN_NODE_REASON_PREEMPTION",
                                 "--reason-message=spot instance reclaimed (a test's drain)",
                                 f"--deadline-remaining-seconds={deadline_s}"],
                                env=clean_env(ISOLATED), capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"ray drain-node ({name}) failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")

    def worker_pids(self, name: str, title: bytes = b"ray::RayTrainWorker") -> list[int]:
        """The node's worker processes whose title starts with ``title`` (Ray Train's workers, by default), less
        their own children (a DataLoader's workers, forked with the same title)."""
        titled = {}
        for pid in _processes(self.nodes[name]):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title):
                    titled[pid] = _parent(pid)
        return [pid for pid, parent in titled.items() if parent not in titled]

    def stop(self) -> None:
        _kill([pid for mark in [*self.nodes.values(), self.mark] for pid in _processes(mark)])
        self.nodes.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _ray_start(self, name: str, options: list[str], hidden: Path | None = None) -> None:
        mark = self.mark if name == "head" else f"{self.mark}-{name}"
        env = clean_env({"DDP_DEVTOOLS_MARK": mark, **ISOLATED})
        env.pop("RAY_ADDRESS", None)
        # Each node's agents on ports of their own: several nodes share this machine. (Not loopback only: Ray turns
        # 127.0.0.1 into the machine's address, services.resolve_ip_for_localhost, and its GCS and raylets listen on
        # every address whatever --node-ip-address says; seen with `ss -ltnp`.)
        options = [*options, f"--dashboard-agent-listen-port={free_port()}",
                   f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
                   f"--metrics-export-port={free_port()}"]
        command = [str(BIN_DIR / "ray"), "start", *options]
        if hidden is not None:
            # The node's processes (ray start's raylet and all it starts) inherit the namespace and its tmpfs.
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                       'mount -t tmpfs tmpfs "$0" && exec "$@"', str(hidden), *command]
        started = time.monotonic()
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=os.getcwd())
        if result.returncode != 0:
            raise RuntimeError(f"ray start ({name}) failed after {time.monotonic() - started:.1f}s:\n"
                               f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
        if name != "head":
            self.nodes[name] = mark


def _processes(mark: str) -> list[int]:
    """A node's processes: the marked ones (its raylet; the head's GCS too) and all they started. Ray's workers and
    agents set their process titles over their environment, so the mark is found in their parents alone."""
    found = marked(mark)
    return list(dict.fromkeys([*found, *(child for pid in found for child in descendants(pid))]))


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _parent(pid: int) -> int:
    # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses, so read after the last ")".
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
