"""The collectives of one FSDP training step, counted: ``torchrun --nproc-per-node 2 -m
tests.workers.fsdp_collectives PRECISION`` wraps a small convolutional network with BatchNorm in every block
(--sync fsdp's units: the blocks and the root), runs one forward and backward under that precision, and prints
``units N all-gathers A reduce-scatters R unshards U batchnorm-compute DTYPES`` on rank 0: DTYPES are the input/weight
dtypes of every batch-norm kernel the step ran (forward and backward)."""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.build import autocast_for
from trainer.config import DistConfig
from trainer.distributed import process_group
from trainer.gradsync import SyncOptions
from trainer.launchers import identity_from_env
from trainer.sharding import FSDPSync

# torch 2.14 gathers with all_gather_single and reduces with reduce_scatter_single; earlier releases with the
# *_tensor functions: whichever this torch has, each call is one collective.
GATHERS = ("all_gather_single", "all_gather_into_tensor")
SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(inputs)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(8)
        self.blocks = nn.Sequential(Block(8), Block(8), Block(8))
        self.head = nn.Linear(8, 4)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.norm(self.stem(inputs)))).mean((2, 3)))


class NormInputs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "batch_norm" in func.__name__ and len(args) > 1 and isinstance(args[0], torch.Tensor):
            weight = args[1] if isinstance(args[1], torch.Tensor) else None
            self.dtypes.add(f"{_name(args[0])}/{_name(weight) if weight is not None else 'none'}")
        return func(*args, **(kwargs or {}))


def _name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def counting(calls: Counter[str], name: str) -> None:
    original = getattr(dist, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return original(*args, **kwargs)

    setattr(dist, name, counted)


def counting_unshards(calls: Counter[str]) -> None:
    """Each unit's unshard that does work (its parameters were not gathered already): at one rank FSDP runs no
    collective, and this is what a unit kept gathered from forward to backward saves."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    original = FSDPParamGroup.unshard

    def counted(group: FSDPParamGroup, *args: Any, **kwargs: Any) -> Any:
        if group._all_gather_result is None and not group.is_unsharded:
            calls["unshard"] += 1
        return original(group, *args, **kwargs)

    FSDPParamGroup.unshard = counted  # type: ignore[method-assign]


def main(precision: str) -> None:
    with process_group(DistConfig(), identity_from_env(os.environ), torch.device("cpu")) as runtime:
        torch.manual_seed(0)
        sync = FSDPSync(runtime, SyncOptions(precision, None, "the test's net"))
        model = sync.wrap(Net())
        calls: Counter[str] = Counter()
        for name in (*GATHERS, *SCATTERS):
            if hasattr(dist, name):
                counting(calls, name)
        counting_unshards(calls)
        norms = NormInputs()
        with norms, autocast_for(precision, runtime.device):
            outputs = model(torch.randn(4, 3, 8, 8))
        outputs.float().sum().backward()
        if runtime.is_main:
            gathers, scatters = sum(calls[name] for name in GATHERS), sum(calls[name] for name in SCATTERS)
            print(f"units {len(sync.units) + 1} all-gathers {gathers} reduce-scatters {scatters} unshards "
                  f"{calls['unshard']} batchnorm-compute {','.join(sorted(norms.dtypes))}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
