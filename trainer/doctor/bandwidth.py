"""All-reduce bandwidth, timed on the slowest rank, as nccl-tests define it; each size's values checked too."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.doctor.checks import FAIL, OK, Outcome, Probe, synchronize
from trainer.errors import described


@dataclass(frozen=True)
class Bandwidth:
    size_mb: float
    time_ms: float
    algbw_gbps: float
    busbw_gbps: float  # algbw x 2(n-1)/n: what each link carries in a ring all-reduce


def measure_bandwidth(probe: Probe, size_mb: float, iterations: int) -> tuple[Bandwidth, Outcome]:
    """Time float32 all-reduces of ``size_mb`` (10^6 bytes), then check one such all-reduce's values."""
    n = probe.world_size
    numel = max(1, round(size_mb * 1e6 / 4))
    data = torch.zeros(numel, dtype=torch.float32, device=probe.device)
    dist.all_reduce(data)  # warm-up: the first call of a size sets up buffers and connections
    synchronize(probe.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(data)
    synchronize(probe.device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=probe.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # an all-reduce is as fast as its slowest rank
    seconds = max(elapsed.item() / iterations, 1e-9)  # a clock tick, not zero, for sizes below its resolution
    algbw = numel * 4 / seconds / 1e9
    bandwidth = Bandwidth(size_mb, seconds * 1e3, algbw, algbw * 2 * (n - 1) / n)

    # Large messages take other algorithms and chunking than the small checks: check their values too.
    op = f"all_reduce_sum {size_mb:g} MB"
    data.fill_(probe.rank + 1)
    dist.all_reduce(data)
    want = n * (n + 1) / 2
    wrong = (data != want).nonzero()
    if len(wrong):
        first = int(wrong[0])
        detail = (f"{len(wrong)} of {numel} elements wrong; element {first}: expected {want:g}, "
                  f"got {data[first].item():g}")
        return bandwidth, Outcome(probe.rank, op, FAIL, detail, seconds * 1e3)
    return bandwidth, Outcome(probe.rank, op, OK, "", seconds * 1e3)


def run_bandwidth(probe: Probe, sizes_mb: Sequence[float], iterations: int) -> tuple[list[Bandwidth], list[Outcome]]:
    bandwidths, outcomes = [], []
    for size_mb in sizes_mb:
        try:
            bandwidth, outcome = measure_bandwidth(probe, size_mb, iterations)
        except Exception as error:  # a collective that raised or timed out: stop here, as run_checks does
            outcomes.append(Outcome(probe.rank, f"all_reduce_sum {size_mb:g} MB", FAIL, described(error), 0.0))
            break
        bandwidths.append(bandwidth)
        outcomes.append(outcome)
    return bandwidths, outcomes
