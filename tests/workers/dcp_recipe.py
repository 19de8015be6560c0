"""docs/sharded.md's recipe, as a user with torch alone runs it: ``torchrun --nproc-per-node 2 -m
tests.workers.dcp_recipe CHECKPOINT WIDTH BLOCKS``. The user's own FSDP2 model (InitWeightsTask's stack of
ScaledStack blocks, sharded with fully_shard), its state dict from get_model_state_dict, a plain ``dcp.load``
with torch's own reader (over the default process group), set_model_state_dict; rank 0 prints the layers'
whole weights' sums (gathered from every rank's shards), which the test compares with the
checkpoint's."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard

from tests.support.tasks import ScaledStack


def main(checkpoint: str, width: int, blocks: int) -> None:
    dist.init_process_group("gloo")
    model = nn.Sequential(*(ScaledStack(width) for _ in range(blocks)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(model, state["model"])
    whole = {name: value.full_tensor().double().sum().item() for name, value in model.state_dict().items()}
    if dist.get_rank() == 0:  # the whole tensors: every rank's shards, gathered (one line: torchrun merges outputs)
        print(json.dumps({"sums": whole}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
