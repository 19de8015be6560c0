"""One rank of figure 12: ``torchrun ... -m bench.workers.sharded_checkpoints PHASE SYNC WIDTH BLOCKS FOLDER``.

A stack of BLOCKS Linear(WIDTH, WIDTH) layers with AdamW under --sync SYNC (fsdp: built on the meta device, given
only this rank's shards), through the trainer's own state parts and CheckpointManager, checkpoints in FOLDER:

  save    one AdamW step, then a synchronous save (format 5 under fsdp, 3 under ddp), timed (the slowest rank),
          and the same tensors written by one ``torch.save`` per rank into FOLDER/raw (what format 4 did; under
          ddp, rank 0 alone): the save against a raw write. The growth of memory over the whole phase, from
          before the model is built, is a fresh run's (model, gradients, AdamW's state, the save).
  resume  the model and optimizer built, then the newest checkpoint in FOLDER restored (whatever sync and world
          size wrote it): the growth of memory during the restore alone (RssAnon, sampled every millisecond),
          the bytes of checkpoint this rank read, and, at the same world size, BENCH_ROUNDS (3) timed rounds of a
          restore against one ``torch.load`` of its own raw file, alternately first.

Each rank writes its record to FOLDER/records/PHASE-SYNC-WORLD-rankR.json; the figure keeps the worst rank's.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from bench.workers.sharded import linear_stack
from devtools.memory import PeakSampler
from trainer.build import state_parts
from trainer.checkpoint import CheckpointManager, RestoreContext, TaskRecord, TrainingPosition, add_run_parts
from trainer.config import CheckpointConfig, DistConfig
from trainer.distributed import process_group
from trainer.launchers import identity_from_env

BATCH = 8
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))  # of the timed resume against a raw load


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _held(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [*model.parameters(), *(value for state in optimizer.state.values() for value in state.values()
                                      if isinstance(value, torch.Tensor))]
    return sum(_local(tensor).nbytes for tensor in tensors)


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def main(phase: str, method: str, width: int, blocks: int, folder: str) -> None:
    identity = identity_from_env({**os.environ, "DDP_JOB_ID": f"bench-sharded-checkpoints-{phase}"})
    with process_group(DistConfig(), identity, torch.device("cpu")) as runtime:
        sampler = PeakSampler()
        sync, model, wrapped, optimizer = linear_stack(method, width, blocks, runtime)
        parts = state_parts(model, optimizer, torch.amp.GradScaler("cpu", enabled=False))
        add_run_parts(parts, TrainingPosition(step=1), TaskRecord("bench", "bench", {}), {})
        manager = CheckpointManager(CheckpointConfig(keep_last=2), folder, runtime, logging.getLogger("bench"))
        manager.prepare()
        raw = Path(folder) / "raw" / f"rank-{identity.rank}.pt"
        record: dict[str, object] = {"rank": identity.rank, "phase": phase, "sync": method}
        if phase == "save":
            inputs = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(identity.rank))
            wrapped(inputs).square().mean().backward()
            sync.after_backward(wrapped)
            optimizer.step()
            dist.barrier()
            started = time.perf_counter()
            manager.save(parts.capture(identity.world_size))
            record["save_s"] = _slowest(time.perf_counter() - started)
            own = {name: _local(value) for name, value in model.state_dict().items()}
            own.update({f"{index}.{key}": _local(value) for index, state in enumerate(optimizer.state.values())
                        for key, value in state.items()})
            dist.barrier()
            started = time.perf_counter()
            if sync.sharded or identity.is_main:
                raw.parent.mkdir(parents=True, exist_ok=True)
                with open(raw, "wb") as handle:
                    torch.save(own, handle)
                    handle.flush()
                    os.fsync(handle.fileno())
            record["raw_save_s"] = _slowest(time.perf_counter() - started)
            record["fresh_grown"] = sampler.stop()
        else:
            sampler.stop()
            held_before = _held(model, optimizer)
            dist.barrier()
            sampler = PeakSampler()
            started = time.perf_counter()
            loaded = manager.load("latest")
            assert loaded is not None, f"no checkpoint in {folder}"
            source = loaded.shard_source(manager.side_group())
            parts.restore(loaded.state, RestoreContext(identity.rank, identity.world_size, loaded.state.world_size,
                                                       0, 1, loaded.location, source))
            record["resume_s"] = _slowest(time.perf_counter() - started)
            record["grown"] = sampler.stop()
            record["bytes_read"] = getattr(source, "bytes_read", None)
            record["saved_format"] = loaded.manifest["format"]
            record["share"] = _held(model, optimizer) - held_before + sum(
                _local(parameter).nbytes for parameter in model.parameters())  # its parameters and AdamW state
            own_raw = Path(folder) / "raw" / f"rank-{identity.rank if sync.sharded else 0}.pt"
            same_layout = loaded.manifest["format"] == (5 if sync.sharded else 3)  # the same decision on every rank
            if same_layout and loaded.state.world_size == identity.world_size:
                # Timed again in rounds, the raw load and the restore alternately first: both read files the save
                # just wrote (in the page cache or not, alike), and one round alone is at the mercy of the cache.
                record["rounds"] = []
                for round_index in range(ROUNDS):
                    times = {}
                    for kind in ("raw", "restore") if round_index % 2 == 0 else ("restore", "raw"):
                        dist.barrier()
                        started = time.perf_counter()
                        if kind == "raw":
                            torch.load(own_raw, weights_only=True)
                        else:
                            again = manager.load("latest")
                            assert again is not None
                            parts.restore(again.state, RestoreContext(
                                identity.rank, identity.world_size, again.state.world_size, 0, 1, again.location,
                                again.shard_source(manager.side_group())))
                        times[kind] = _slowest(time.perf_counter() - started)
                    record["rounds"].append(times)
        manager.close()
        # A file per rank: torchrun merges the ranks' standard outputs, and two lines may interleave there.
        records = Path(folder) / "records"
        records.mkdir(parents=True, exist_ok=True)
        (records / f"{phase}-{method}-{identity.world_size}-rank{identity.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
