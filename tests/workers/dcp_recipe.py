"""docs/sharded.md's recipe, as a user with torch alone runs it: ``restore`` holds its lines as the page shows them.

``torchrun --nproc-per-node 2 -m tests.workers.dcp_recipe CHECKPOINT WIDTH BLOCKS``: the user's own FSDP2 model
(InitWeightsTask's stack of ScaledStack blocks, sharded with fully_shard) and an SGD optimizer, restored over the
default process group with torch's own reader; rank 0 prints the layers' whole weights' sums (gathered from every
rank's shards) and the restored learning rate, which the test compares with the checkpoint's. The same ``restore``
runs in a process with no process group (tests/integration/test_sharded.py)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from tests.support.tasks import ScaledStack


def restore(checkpoint: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    del state["optimizer"]["param_groups"]  # not tensors: in the checkpoint's state.pt, not in DCP's files
    dcp.load(state, checkpoint_id=checkpoint)
    saved = torch.load(f"{checkpoint}/state.pt", weights_only=True)
    state["optimizer"]["param_groups"] = saved["optimizer"]["param_groups"]
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def main(checkpoint: str, width: int, blocks: int) -> None:
    dist.init_process_group("gloo")
    model = nn.Sequential(*(ScaledStack(width) for _ in range(blocks)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the checkpoint's groups replace this learning rate
    restore(checkpoint, model, optimizer)
    whole = {name: value.full_tensor().double().sum().item() for name, value in model.state_dict().items()}
    if dist.get_rank() == 0:  # the whole tensors: every rank's shards, gathered (one line: torchrun merges outputs)
        print(json.dumps({"sums": whole, "lr": optimizer.param_groups[0]["lr"]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
