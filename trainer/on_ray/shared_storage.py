"""The run's folder (and a checkpoint folder on a path) seen by every node, checked before training.

Ray's own check that its storage is shared runs only when it uploads a checkpoint, and ddp-train-ray's reports
upload nothing (they point at the trainer's checkpoints): on a cluster whose ``--ray-storage-path`` is each node's
own disk, the checkpoints and Ray's pointers would land on rank 0's node alone, and a restart elsewhere would train
from the start, or a driver started again fail in Ray's own check. So the driver writes a marker with a token of
this start in each folder; a task on every live node that can hold a worker reads it (``check_every_node``), and
each worker reads it again as it starts (``check_this_node``: a node that joined later). A node that does not see
it ends the run in one line naming the node and the folder.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.on_ray.settings import RayLaunchError

__all__ = ["Markers", "NotShared", "check_every_node", "check_this_node", "markers"]

MARKER = ".ddp-shared-check"  # and the start's token: MARKER-TOKEN, one per driver's start
NODE_CHECK_TIMEOUT_S = 120.0  # a node's check task: scheduling on a busy node and starting a worker process


class NotShared(RayLaunchError):
    """A node does not see a folder the run needs shared."""


@dataclass(frozen=True)
class Markers:
    folders: tuple[str, ...]
    token: str

    def missing_here(self) -> str | None:
        """The first folder whose marker this process does not read with this start's token, or None."""
        for folder in self.folders:
            try:
                if (Path(folder) / f"{MARKER}-{self.token}").read_text().strip() == self.token:
                    continue
            except OSError:
                pass
            return folder
        return None


@contextlib.contextmanager
def markers(folders: Sequence[str]) -> Iterator[Markers]:
    """A marker in each of ``folders`` (made if need be), for as long as the run's driver runs."""
    token = secrets.token_hex(8)
    written: list[Path] = []
    try:
        for folder in dict.fromkeys(folders):
            # A name of its own per start: two runs sharing a checkpoint folder must not take each other's.
            path = Path(folder) / f"{MARKER}-{token}"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(token)
            except OSError as error:
                raise RayLaunchError(f"cannot write {path} ({error.strerror or error}): the run needs that folder "
                                     f"writable and shared by every node") from None
            written.append(path)
        yield Markers(tuple(dict.fromkeys(folders)), token)
    finally:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink()


def _not_shared(node: str, folder: str) -> NotShared:
    return NotShared(f"node {node} does not see {folder} as the driver wrote it: the Ray run's folder (and a "
                     f"checkpoint folder on a path) must be one folder every node mounts at the same path (NFS, a "
                     f"shared volume); choose such a --ray-storage-path, or put the checkpoints on an object store "
                     f"(--checkpoint-dir s3://...)")


def _node_name() -> str:
    return socket.gethostname() + (f" ({address})" if (address := os.environ.get("RAY_NODE_IP_ADDRESS")) else "")


def check_this_node(found: Markers) -> None:
    """In a worker: NotShared where this node does not see the driver's markers."""
    folder = found.missing_here()
    if folder is not None:
        raise _not_shared(_node_name(), folder)


def check_every_node(ray: Any, nodes: Sequence[dict[str, Any]], found: Markers) -> None:
    """On the driver: a task of no CPUs on each of ``nodes`` (ray.nodes() entries) reads the markers."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def missing_on_node(given: Markers) -> str | None:
        return given.missing_here()

    remote = ray.remote(num_cpus=0, max_retries=0)(missing_on_node)
    pending = {node["NodeID"]: remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node["NodeID"], soft=False)).remote(found) for node in nodes}
    names = {node["NodeID"]: f"{node.get('NodeName') or node.get('NodeManagerAddress')} "
                             f"(id {node['NodeID'][:8]})" for node in nodes}
    for node_id, reference in pending.items():
        try:
            folder = ray.get(reference, timeout=NODE_CHECK_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - a node that died or stayed busy meanwhile: Ray's to handle
            print(f"warning: could not check node {names[node_id]} sees the run's folders ({type(error).__name__}); "
                  f"its workers check as they start", flush=True)
            continue
        if folder is not None:
            raise _not_shared(names[node_id], folder)
