"""The doctor's CUDA driver check: this rank's NVIDIA driver against this torch's CUDA (trainer.cuda_driver).

Decided before the group is joined, by the trainer's rules: a driver too old for CUDA to start, where CUDA
was wanted, fails (the group's backend follows the device, which such a rank cannot have); a driver below
the minimum on which CUDA started anyway passes with the warning; no driver, or a CPU build, is a skip. Every
rank's row then goes to rank 0 through the store, before the group (share_driver_rows): where one failed, rank 0's
table says which rank on which host, every rank says so, and none joins.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from trainer import cuda_driver
from trainer.doctor.checks import FAIL, OK, SKIP, Outcome
from trainer.errors import RendezvousError
from trainer.launchers import DistIdentity

OP = "cuda_driver"


def driver_outcome(rank: int, requested: str, node: cuda_driver.NodeSources | None = None) -> Outcome:
    """This rank's row of the results table; ``requested`` is --device."""
    if requested == "cpu":
        return Outcome(rank, OP, SKIP, "--device cpu uses no GPU", 0.0)
    node = node or cuda_driver.THIS_NODE
    check = cuda_driver.driver_check(node)
    if check.verdict != cuda_driver.TOO_OLD:
        return Outcome(rank, OP, OK if check.verdict == cuda_driver.OK else SKIP, check.describe(), 0.0)
    if node.cuda_devices() > 0:
        return Outcome(rank, OP, OK, cuda_driver.working_cuda_warning(check) or check.describe(), 0.0)
    refusal = cuda_driver.no_device_refusal(requested, check, node)
    if refusal is not None:
        return Outcome(rank, OP, FAIL, refusal, 0.0)
    return Outcome(rank, OP, SKIP, f"no GPU attached here (no /dev/nvidiaN), and {check.describe()}", 0.0)


# Told before the group is joined, through the store, which needs no device. Such a rank cannot join: the group's
# backend follows the device, and on NCCL's (every other rank has a GPU) ProcessGroupNCCL refuses a process whose
# CUDA does not start ("only supported with GPUs, no GPUs found"); a rank that simply left would leave the others
# waiting in the group for it until --rendezvous-timeout-s.
ROW_KEY = "ddp-doctor/cuda-driver/row/"
VERDICT_KEY = "ddp-doctor/cuda-driver/failed"
READ_KEY = "ddp-doctor/cuda-driver/read/"


@dataclass(frozen=True)
class DriverRows:
    """What the ranks' driver checks found: the failed rows, on every rank; every rank's row and the environment it
    was found in (rank, node, host...), on rank 0 only, for its tables."""

    failed: list[Outcome]
    everyone: list[tuple[dict[str, object], Outcome]]


def share_driver_rows(store: dist.Store, identity: DistIdentity, environment: dict[str, object], outcome: Outcome,
                      timeout_s: float) -> DriverRows:
    """Every rank's row to rank 0 and the failed ones back to every rank; rank 0 keeps the store open until every
    rank has read them (its end closes the store)."""
    timeout = timedelta(seconds=timeout_s)
    store.set(f"{ROW_KEY}{identity.rank}", json.dumps([environment, asdict(outcome)]))
    if identity.is_main:
        keys = [f"{ROW_KEY}{rank}" for rank in range(identity.world_size)]
        _wait(store, keys, timeout, "its CUDA driver check")
        rows = [json.loads(value) for value in store.multi_get(keys)]
        everyone = [(environment, Outcome(**row)) for environment, row in rows]
        failed = [row for _, row in everyone if row.status == FAIL]
        store.set(VERDICT_KEY, json.dumps([asdict(row) for row in failed]))
        if failed:
            with contextlib.suppress(RendezvousError):  # a rank gone since: it was told all it could be
                _wait(store, [f"{READ_KEY}{rank}" for rank in range(1, identity.world_size)], timeout,
                      "that it read the CUDA driver's verdict")
        return DriverRows(failed, everyone)
    _wait(store, [VERDICT_KEY], timeout, "the CUDA driver's verdict", from_rank_0=True)
    failed = [Outcome(**row) for row in json.loads(store.get(VERDICT_KEY))]
    store.set(f"{READ_KEY}{identity.rank}", "")
    return DriverRows(failed, [])


def _wait(store: dist.Store, keys: list[str], timeout: timedelta, what: str, from_rank_0: bool = False) -> None:
    try:
        store.wait(keys, timeout)
    except RuntimeError:  # torch's DistStoreError: the wait timed out, or the store is gone
        if from_rank_0:
            raise RendezvousError(f"rank 0 never sent {what} within {timeout.total_seconds():g}s: it stopped, or "
                                  f"raise --rendezvous-timeout-s") from None
        missing = [key.rsplit("/", 1)[1] for key in keys if not _present(store, key)]
        raise RendezvousError(f"rank(s) {', '.join(missing)} never sent {what} within {timeout.total_seconds():g}s: "
                              f"start every rank, or raise --rendezvous-timeout-s") from None


def _present(store: dist.Store, key: str) -> bool:
    try:
        return store.check([key])
    except RuntimeError:
        return False
