"""One rank of figure 11: ``torchrun ... -m bench.workers.sharded METHOD WIDTH BLOCKS STEPS FOLDER``.

Builds a stack of BLOCKS Linear(WIDTH, WIDTH) layers (under fsdp on the meta device, given only this rank's
shards), wraps it with the trainer's --sync METHOD (ddp or fsdp), trains STEPS AdamW steps on a fixed batch, then
saves one checkpoint through the trainer's own state parts and CheckpointManager into FOLDER. Rank 0 prints one
JSON line: the bytes of parameters, gradients and optimizer state this rank holds (its tensors' local storage),
the growth of its memory (RssAnon, sampled every millisecond) from before the model was built to the end of
training, the median step time, and the save's time (the slowest rank's).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from devtools.memory import PeakSampler
from trainer.build import state_parts
from trainer.checkpoint import CheckpointManager, TaskRecord, TrainingPosition, add_run_parts
from trainer.config import CheckpointConfig, DistConfig
from trainer.distributed import Runtime, process_group
from trainer.gradsync import GradSync, build_grad_sync
from trainer.launchers import identity_from_env
from trainer.sharding import initialise_on_device

BATCH = 16


def _held(tensors: list[torch.Tensor]) -> int:
    return sum((tensor.to_local() if isinstance(tensor, DTensor) else tensor).nbytes for tensor in tensors)


def linear_stack(method: str, width: int, blocks: int, runtime: Runtime
                 ) -> tuple[GradSync, nn.Module, nn.Module, torch.optim.Optimizer]:
    """BLOCKS Linear(WIDTH, WIDTH) under the trainer's --sync METHOD, with AdamW: (sync, model, wrapped, optimizer).
    Sharded: built on the meta device and given only this rank's shards (--meta-init), as a model too large for
    one rank must be; DDP: built whole, as it must be."""
    torch.manual_seed(0)
    sync = build_grad_sync(method, runtime)
    with torch.device("meta" if sync.sharded else "cpu"):
        model = nn.Sequential(*(nn.Linear(width, width) for _ in range(blocks)))
    wrapped = sync.wrap(model)
    if sync.sharded:
        initialise_on_device(model, torch.device("cpu"), None, "bench")
    return sync, model, wrapped, torch.optim.AdamW(model.parameters(), lr=1e-4)


def main(method: str, width: int, blocks: int, steps: int, folder: str) -> None:
    identity = identity_from_env({**os.environ, "DDP_JOB_ID": f"bench-sharded-{method}"})
    with process_group(DistConfig(), identity, torch.device("cpu")) as runtime:
        sampler = PeakSampler()
        sync, model, wrapped, optimizer = linear_stack(method, width, blocks, runtime)
        inputs = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(identity.rank))
        times = []
        for _ in range(steps):
            dist.barrier(group=runtime.control)
            started = time.perf_counter()
            wrapped(inputs).square().mean().backward()
            sync.after_backward(wrapped)
            if len(times) == steps - 1:
                grads = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
                held = {"parameters": _held(list(model.parameters())), "gradients": _held(grads),
                        "optimizer": 0}
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            times.append(time.perf_counter() - started)
        held["optimizer"] = _held([value for state in optimizer.state.values() for value in state.values()
                                   if isinstance(value, torch.Tensor) and value.dim() > 0])
        grown = sampler.stop()

        parts = state_parts(model, optimizer, torch.amp.GradScaler("cpu", enabled=False))
        add_run_parts(parts, TrainingPosition(step=steps), TaskRecord("bench", "bench", {}), {})
        manager = CheckpointManager(CheckpointConfig(keep_last=2), folder, runtime, logging.getLogger("bench"))
        manager.prepare()
        dist.barrier(group=runtime.control)
        started = time.perf_counter()
        manager.save(parts.capture(identity.world_size))
        save_s = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(save_s, op=dist.ReduceOp.MAX, group=runtime.control)
        manager.close()
        if identity.is_main:
            full = sum(parameter.numel() for parameter in model.parameters()) * 4
            print(json.dumps({"method": method, "held": held, "grown": grown, "full_parameter_bytes": full,
                              "step_s": statistics.median(times[1:] or times), "save_s": float(save_s.item()),
                              "samples_per_s": BATCH * identity.world_size / statistics.median(times[1:] or times),
                              "units": sync.describe()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
