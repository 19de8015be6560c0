"""Reaching the Ray cluster, and what it can place: each refusal one line in seconds, where Ray itself would retry
for minutes or wait for room forever."""

from __future__ import annotations

import os
import socket
from typing import Any

from trainer.errors import first_line
from trainer.on_ray.settings import RayLaunchError, RayRun

__all__ = ["RAY_MISSING", "check_capacity", "check_reachable", "connect", "import_ray"]

# How long the cluster's address may take to accept a connection before the run is refused.
CONNECT_TIMEOUT_S = 10.0
RAY_MISSING = "Ray Train is not installed: pip install 'ddp-deploy[ray]' (or ray[default,train] itself)"


def import_ray() -> Any:
    try:
        import ray
        import ray.train  # noqa: F401 - the Train library, an extra of ray
        import ray.train.torch  # noqa: F401
    except ImportError:
        raise RayLaunchError(RAY_MISSING) from None
    return ray


def connect(ray: Any, ray_run: RayRun) -> None:
    address = ray_run.address or os.environ.get("RAY_ADDRESS", "")
    check_reachable(address)
    try:
        ray.init(address=ray_run.address)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise _unreachable(address or "the local machine", first_line(error)[:300]) from None


def _unreachable(where: str, why: str) -> RayLaunchError:
    return RayLaunchError(f"cannot reach the Ray cluster at {where} ({why}); start one with `ray start --head`, or "
                          f"pass its GCS address as --ray-address HOST:PORT")


def check_reachable(address: str) -> None:
    """A cluster address HOST:PORT (or ray://HOST:PORT) that does not answer: one line in seconds, where ray.init
    would retry for minutes."""
    bare = address.removeprefix("ray://")
    host, _, port = bare.rpartition(":")
    if "://" in bare or not host or not port.isdigit():
        return  # "auto", "local", none, or a dashboard's http:// address: ray.init finds the cluster itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise _unreachable(address, str(error.strerror or error)) from None


def alive_nodes(ray: Any) -> list[dict[str, Any]]:
    """The cluster's live nodes, as ray.nodes() describes them (public API)."""
    return [node for node in ray.nodes() if node.get("Alive")]


def check_capacity(ray: Any, ray_run: RayRun) -> None:
    """Refuse at once a run the cluster cannot place (Ray itself would wait for room forever): how many workers
    fit on the live nodes, each on one node with its CPUs (and GPU)."""
    if ray_run.cluster_autoscales:
        return
    fits = 0
    for node in alive_nodes(ray):
        resources = node.get("Resources", {})
        by_cpu = int(resources.get("CPU", 0) // ray_run.cpus_per_worker) if ray_run.cpus_per_worker else 10**6
        fits += min(by_cpu, int(resources.get("GPU", 0))) if ray_run.use_gpu else by_cpu
    if fits < ray_run.num_workers[0]:
        need = f"{ray_run.cpus_per_worker:g} CPU" + (" and 1 GPU" if ray_run.use_gpu else "")
        raise RayLaunchError(f"--ray-workers {ray_run.workers_text}: the Ray cluster has room for {fits} worker(s) "
                             f"of {need} each; add nodes, lower --ray-workers or --ray-cpus-per-worker, or pass "
                             f"--ray-cluster-autoscales if its autoscaler adds nodes")
