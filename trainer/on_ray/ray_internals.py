"""Everything ddp-train-ray takes from Ray beyond ``ray.init``, ``ray.train``'s configs and its report: one module,
so that a Ray release that moves a name breaks here, and only here.

Public or DeveloperAPI names, but one: ``ray.train.backend.Backend`` (DeveloperAPI), a ``TorchConfig`` whose
``backend_cls`` is ours, ``ray.util.get_node_ip_address``, ``ray.train.get_context()``'s ranks, the runtime
context's node id, and Ray Train's documented environment variables (``RAY_TRAIN_V2_ENABLED``,
``RAY_CHDIR_TO_TRIAL_DIR``). The private one: ``ray._private.state.state.get_draining_nodes`` (``draining_nodes``).
``SUPPORTED_RAY`` is the range these were checked on (tests/deploy/test_ray.py runs a cluster on each end of it).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

__all__ = ["SUPPORTED_RAY", "check_ray_version", "draining_nodes", "runtime_working_dir", "this_node_id",
           "train_v2_enabled", "trainer_process_group", "workers_keep_their_folder"]

# The Ray releases ddp-train-ray is tested on (pyproject's ray extra says the same: tests/unit/test_on_ray.py).
SUPPORTED_RAY = ("2.58.0", "2.61")  # from the first, below the second
V2_ENABLED = "RAY_TRAIN_V2_ENABLED"  # Ray Train V2 unless "0" (its default on every release in SUPPORTED_RAY)
CHDIR_TO_RUN_FOLDER = "RAY_CHDIR_TO_TRIAL_DIR"  # read by the TorchTrainer as it builds its callbacks


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


def check_ray_version(version: str) -> str | None:
    """What is wrong with this Ray release for ddp-train-ray, or None. The driver's Ray must also be its cluster's
    (Ray's own rule): this checks the driver's."""
    low, high = SUPPORTED_RAY
    if _release(low) <= _release(version) < _release(high):
        return None
    return (f"Ray {version} is not one ddp-train-ray is tested on (>= {low}, < {high}): pip install "
            f"'ray[default,train]>={low},<{high}' at the version of your cluster")


def train_v2_enabled() -> bool:
    return os.environ.get(V2_ENABLED, "1") != "0"


@contextlib.contextmanager
def workers_keep_their_folder() -> Iterator[None]:
    """Ray Train moves each worker into a node-local folder of the run's by default; this keeps them where Ray
    started them (the job's --working-dir, unpacked on their node), so the trainer's relative paths mean there
    what they mean to the driver. Read as the TorchTrainer is built and fits: set for that, then restored."""
    before = os.environ.get(CHDIR_TO_RUN_FOLDER)
    os.environ[CHDIR_TO_RUN_FOLDER] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CHDIR_TO_RUN_FOLDER, None)
        else:
            os.environ[CHDIR_TO_RUN_FOLDER] = before


def runtime_working_dir(ray: Any) -> str | None:
    """The job's runtime environment's working_dir (``ray job submit --working-dir``, ``ray.init(runtime_env=)``):
    every worker starts in its node's copy of it. None without one."""
    with contextlib.suppress(Exception):  # noqa: BLE001 - a driver without a runtime context has none
        working_dir = ray.get_runtime_context().runtime_env.get("working_dir")
        return str(working_dir) if working_dir else None
    return None


def _address_and_port() -> tuple[str, int]:
    """This node's address as Ray knows it, and a free port on it: where worker 0's trainer listens."""
    import ray.util

    address = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return address, int(probe.getsockname()[1])


def _set_torch_variables(address: str, port: int) -> None:
    """torchrun's variables, from Ray Train's context: what the trainer's launcher detection reads
    (trainer/launchers/ray_train.py)."""
    import ray.train

    context = ray.train.get_context()
    os.environ.update({"MASTER_ADDR": address, "MASTER_PORT": str(port),
                       "RANK": str(context.get_world_rank()), "WORLD_SIZE": str(context.get_world_size()),
                       "LOCAL_RANK": str(context.get_local_rank()),
                       "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
                       "NODE_RANK": str(context.get_node_rank())})


def trainer_process_group() -> Any:
    """A TorchConfig whose backend names worker 0's address and a free port in every worker and makes no process
    group: the trainer joins its own (trainer/on_ray/__init__.py says why)."""
    from ray.train.backend import Backend
    from ray.train.torch import TorchConfig

    class AddressOnly(Backend):  # type: ignore[misc]
        share_cuda_visible_devices = True  # each worker sees its node's GPUs and takes LOCAL_RANK's, as torchrun's

        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            address, port = worker_group.execute_single(0, _address_and_port)
            worker_group.execute(_set_torch_variables, address=address, port=port)

        def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
            pass  # the trainer destroyed its group as its run ended

    class TrainerProcessGroup(TorchConfig):  # type: ignore[misc]
        @property
        def backend_cls(self) -> type:
            return AddressOnly

    return TrainerProcessGroup()


def this_node_id() -> str:
    """The id (hex) of the Ray node this worker runs on, as ``draining_nodes`` names nodes."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def draining_nodes() -> dict[str, int]:
    """The cluster's nodes being drained (``ray drain-node``, the autoscaler's scale-down, a spot instance's
    reclaim): {node id (hex): the deadline, Unix ms; 0 for none}, as the GCS knows them. Private, on 2.58.0 and 2.60
    alike: Ray Train's own preemption watcher reads the same (ray/train/v2/_internal/execution/preemption.py).
    Ray's public way, ``ray.train.get_preemption_info``, is a barrier of every worker, on a 5 s poll of its own:
    one more collective per step, where the trainer's own step vote already carries the stop."""
    import ray._private.state

    return {str(node): int(deadline_ms) for node, deadline_ms in ray._private.state.state.get_draining_nodes().items()}
