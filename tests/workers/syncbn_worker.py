"""One rank of the SyncBatchNorm tests: trains on its slice of a global batch and saves what it saw.

Started once per rank by tests/integration/test_syncbn.py through devtools/processes.env_ranks:

    python -m tests.workers.syncbn_worker layers --sizes 5,1,3 --out DIR
    python -m tests.workers.syncbn_worker ddp --per-rank 4 --out DIR

The data and models are built here, from fixed seeds, so that the test can rebuild the same global
batch and run plain BatchNorm on it as the reference.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from trainer.config import DistConfig
from trainer.distributed import process_group
from trainer.launchers import identity_from_env
from trainer.syncbn import convert_sync_batchnorm

STEPS = 3
CPU = torch.device("cpu")


@dataclass(frozen=True)
class LayerCase:
    make: Callable[[], _BatchNorm]
    sample_shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32


LAYER_CASES = {
    "bn1d": LayerCase(lambda: nn.BatchNorm1d(4, momentum=None), (4,)),
    "bn1d_sequence": LayerCase(lambda: nn.BatchNorm1d(3, eps=1e-3, momentum=0.3), (3, 6)),
    "bn2d": LayerCase(lambda: nn.BatchNorm2d(3), (3, 5, 4)),
    "bn3d_no_affine": LayerCase(lambda: nn.BatchNorm3d(2, affine=False), (2, 3, 2, 3)),
    "bn2d_bf16": LayerCase(lambda: nn.BatchNorm2d(3), (3, 4, 4), torch.bfloat16),
}


def make_layer(name: str) -> _BatchNorm:
    """The case's layer with non-trivial affine parameters, the same on every rank."""
    layer = LAYER_CASES[name].make()
    if layer.affine:
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            layer.weight.copy_(torch.rand(layer.num_features, generator=generator) + 0.5)
            layer.bias.copy_(torch.randn(layer.num_features, generator=generator))
    return layer


def global_batch(name: str, step: int, total: int) -> tuple[Tensor, Tensor]:
    """Step ``step``'s inputs for all ranks together, and the fixed weights of the loss (y * weights).sum()."""
    case = LAYER_CASES[name]
    generator = torch.Generator().manual_seed(1000 + step)
    # An offset mean and a non-unit spread, so that a wrong mean or variance shows in every output.
    inputs = torch.randn(total, *case.sample_shape, generator=generator) * 2.5 + 4.0
    loss_weights = torch.randn(total, *case.sample_shape, generator=generator)
    return inputs.to(case.dtype), loss_weights


def run_layer(layer: nn.Module, inputs: Tensor, loss_weights: Tensor, dtype: torch.dtype) -> dict[str, Tensor | None]:
    """One training step of ``layer`` alone: output, input gradient and parameter gradients."""
    inputs = inputs.clone().requires_grad_()
    layer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        output = layer(inputs)
        (output.float() * loss_weights).sum().backward()
    weight, bias = layer.weight, layer.bias
    return {
        "output": output.detach(),
        "grad_input": inputs.grad,
        "grad_weight": None if weight is None else weight.grad.clone(),
        "grad_bias": None if bias is None else bias.grad.clone(),
    }


def slice_bounds(sizes: list[int], rank: int) -> tuple[int, int]:
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def layers(rank: int, sizes: list[int]) -> dict[str, object]:
    """Every layer case, trained STEPS steps on this rank's slice, then evaluated rank + 1 times."""
    start, end = slice_bounds(sizes, rank)
    total = sum(sizes)
    results: dict[str, object] = {}
    for name, case in LAYER_CASES.items():
        layer = convert_sync_batchnorm(make_layer(name), CPU)
        steps = []
        for step in range(STEPS):
            inputs, loss_weights = global_batch(name, step, total)
            steps.append(run_layer(layer, inputs[start:end], loss_weights[start:end], case.dtype))
        layer.eval()
        eval_inputs, _ = global_batch(name, STEPS, total)
        # Ranks evaluate different numbers of batches: a collective here would pair with another
        # rank's next one and fail (or hang until the collective timeout).
        with torch.no_grad():
            eval_outputs = [layer(eval_inputs[start:end]) for _ in range(rank + 1)]
        results[name] = {
            "type": type(layer).__name__,
            "steps": steps,
            "running_mean": layer.running_mean,
            "running_var": layer.running_var,
            "num_batches_tracked": layer.num_batches_tracked,
            "eval_output": eval_outputs[-1],
        }
    # Every rank must still be in step: a stray collective above would make this one fail.
    marker = torch.tensor([float(rank)])
    dist.all_reduce(marker)
    results["marker"] = marker
    return results


def convnet() -> nn.Module:
    """A small ConvNet with a 2d and a 1d BatchNorm, initialised the same on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 6 * 6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3),
    )


def ddp_batch(step: int, total: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(2000 + step)
    images = torch.randn(total, 1, 8, 8, generator=generator) + 1.0
    labels = torch.randint(0, 3, (total,), generator=generator)
    return images, labels


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5)


def ddp(rank: int, world_size: int, per_rank: int, group: dist.ProcessGroup | None) -> dict[str, object]:
    """The converted ConvNet under DDP on gloo: STEPS steps of mean cross-entropy on per_rank samples.

    ``group`` is where SyncBatchNorm synchronises: None shares DDP's own (default) group.
    """
    model = DistributedDataParallel(convert_sync_batchnorm(convnet(), CPU, group))
    optimizer = sgd(model)
    losses = []
    for step in range(STEPS):
        images, labels = ddp_batch(step, per_rank * world_size)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = F.cross_entropy(model(images[mine]), labels[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"state": model.module.state_dict(), "losses": losses,
            "types": [type(m).__name__ for m in model.module.modules()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=("layers", "ddp"))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--sizes", default="4,4", help="layers: samples on each rank, comma-separated")
    parser.add_argument("--per-rank", type=int, default=4, help="ddp: samples on each rank")
    args = parser.parse_args()
    identity = identity_from_env(os.environ)
    config = DistConfig(device="cpu", backend="gloo", rendezvous_timeout_s=60, collective_timeout_s=30)
    with process_group(config, identity, CPU):
        if args.scenario == "layers":
            sizes = [int(size) for size in args.sizes.split(",")]
            results = layers(identity.rank, sizes)
        else:
            # Both in one process: DDP's first use imports torch._dynamo, seconds per process.
            results = {
                "default_group": ddp(identity.rank, identity.world_size, args.per_rank, None),
                "dedicated_group": ddp(identity.rank, identity.world_size, args.per_rank,
                                       dist.new_group(backend="gloo")),
            }
    torch.save(results, args.out / f"rank{identity.rank}.pt")


if __name__ == "__main__":
    main()
