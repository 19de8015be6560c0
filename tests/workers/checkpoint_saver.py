"""A process that does nothing but save checkpoints, for tests that kill it mid-save.

``python -m tests.workers.checkpoint_saver DIR STATE_MB [sharded]``: prepares DIR (clearing crashed saves' leftovers),
resumes from the newest valid checkpoint, then saves step after step of a STATE_MB state with
keep_last=2 (``sharded``: its weights a DTensor, written as a sharded checkpoint), announcing each on stdout:
``resumed NAME|none``, ``saving STEP``, ``saved STEP SECONDS``.
"""

from __future__ import annotations

import logging
import sys
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests.support.checkpoint_reading import state_at
from trainer.checkpoint import CheckpointManager
from trainer.config import CheckpointConfig, DistConfig
from trainer.distributed import process_group
from trainer.launchers import identity_from_env

SAVES_AT_MOST = 200  # ends on its own if a test forgets it


def main(checkpoint_dir: str, state_mb: int, sharded: bool = False) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    # Each start is a restart of one job (as under a launcher that restarts it): it takes the folder's lease
    # from the attempt it killed at once.
    identity = identity_from_env({"DDP_JOB_ID": "checkpoint-saver"})
    with process_group(DistConfig(), identity, torch.device("cpu")) as runtime:
        manager = CheckpointManager(CheckpointConfig(keep_last=2), checkpoint_dir, runtime, logging.getLogger("saver"))
        manager.prepare()
        loaded = manager.load("latest")
        print(f"resumed {loaded.location if loaded else 'none'}", flush=True)
        last_step = loaded.manifest["step"] if loaded else 0
        weights = torch.randn(state_mb * 2**18)  # float32: 4 bytes each
        if sharded:
            mesh = init_device_mesh("cpu", (1,))
            weights = distribute_tensor(weights, mesh, [Shard(0)])
        for step in range(last_step + 1, last_step + 1 + SAVES_AT_MOST):
            (weights.to_local() if sharded else weights)[0] = step  # each checkpoint's content differs
            print(f"saving {step}", flush=True)
            started = time.perf_counter()
            manager.save(state_at(step, weights))
            print(f"saved {step} {time.perf_counter() - started:.4f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sharded=sys.argv[3:] == ["sharded"])
