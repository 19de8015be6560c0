"""The collective checks: every operation run with values that show a wrong rank, slot or operation.

Each check returns what it found wrong and never stops early on a wrong value: a rank that skipped a
collective the others still run (the second root, say) would pair its next one with theirs.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce

import torch
import torch.distributed as dist

from trainer.errors import described

WIDTH = 4  # elements per check tensor: a shifted, truncated or mixed-up buffer shows in at least one
OK, FAIL, SKIP, NOT_RUN = "ok", "FAIL", "skip", "not run"

REDUCTIONS: dict[str, tuple[dist.ReduceOp.RedOpType, Callable[[float, float], float]]] = {
    "reduce": (dist.ReduceOp.SUM, operator.add),
    "all_reduce_sum": (dist.ReduceOp.SUM, operator.add),
    "all_reduce_product": (dist.ReduceOp.PRODUCT, operator.mul),
    "all_reduce_max": (dist.ReduceOp.MAX, max),
    "all_reduce_min": (dist.ReduceOp.MIN, min),
}


class Skipped(Exception):
    """The check does not apply to this group."""


@dataclass(frozen=True)
class Outcome:
    rank: int
    op: str
    status: str
    detail: str
    time_ms: float


def contribution(op: str, rank: int, world_size: int) -> list[float]:
    """What ``rank`` sends in ``op``: different for every rank and every element."""
    if op == "all_reduce_product":
        # Only +-1 and +-2, so the product stays exact in float64 (up to thousands of ranks).
        return [(-1.0 if (rank + j) % 3 == 0 else 1.0) * (2.0 if (rank + j) % 8 == 0 else 1.0) for j in range(WIDTH)]
    return [float(rank + 1 + world_size * j) for j in range(WIDTH)]


def reduced(op: str, world_size: int) -> list[float]:
    """The exact answer of a reduction over every rank's contribution (integers: no rounding)."""
    combine = REDUCTIONS[op][1]
    columns = zip(*(contribution(op, rank, world_size) for rank in range(world_size)), strict=True)
    return [reduce(combine, column) for column in columns]


def roots(world_size: int) -> list[int]:
    """Rooted operations run from rank 0 and from the last rank: a root other than 0 takes other paths."""
    return sorted({0, world_size - 1})


@dataclass(frozen=True)
class Probe:
    """One rank's side of the checks. ``sends`` is the one place data goes on the wire."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def roots(self) -> list[int]:
        return roots(self.world_size)

    def truth(self, op: str, of_rank: int) -> list[float]:
        return contribution(op, of_rank, self.world_size)

    def sends(self, op: str, of_rank: int | None = None) -> torch.Tensor:
        """The tensor this rank puts on the wire: its own contribution, or another rank's (scatter)."""
        values = self.truth(op, self.rank if of_rank is None else of_rank)
        return torch.tensor(values, dtype=torch.float64, device=self.device)

    def empty(self) -> torch.Tensor:
        return torch.full((WIDTH,), float("nan"), dtype=torch.float64, device=self.device)


def expect(got: torch.Tensor, want: list[float], where: str) -> list[str]:
    values = got.tolist()
    return [] if values == want else [f"{where}: expected {_numbers(want)}, got {_numbers(values)}"]


def _numbers(values: list[float]) -> str:
    return "[" + ", ".join(f"{value:.12g}" for value in values) + "]"


def check_send_recv(p: Probe) -> list[str]:
    if p.world_size == 1:
        raise Skipped("one rank has no neighbour")
    after, before = (p.rank + 1) % p.world_size, (p.rank - 1) % p.world_size
    from_before, from_after = p.empty(), p.empty()
    # Both directions at once, told apart by tag: with two ranks, both neighbours are the same rank.
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, p.sends("send_recv"), after, tag=1),
        dist.P2POp(dist.isend, p.sends("send_recv"), before, tag=2),
        dist.P2POp(dist.irecv, from_before, before, tag=1),
        dist.P2POp(dist.irecv, from_after, after, tag=2),
    ])
    for work in works:
        work.wait()
    return (expect(from_before, p.truth("send_recv", before), f"from rank {before} (tag 1)")
            + expect(from_after, p.truth("send_recv", after), f"from rank {after} (tag 2)"))


def check_broadcast(p: Probe) -> list[str]:
    problems = []
    for root in p.roots:
        data = p.sends("broadcast") if p.rank == root else p.empty()
        dist.broadcast(data, src=root)
        problems += expect(data, p.truth("broadcast", root), f"from root {root}")
    return problems


def check_reduce(p: Probe) -> list[str]:
    problems = []
    for root in p.roots:
        data = p.sends("reduce")
        dist.reduce(data, dst=root, op=REDUCTIONS["reduce"][0])
        if p.rank == root:
            problems += expect(data, reduced("reduce", p.world_size), f"sum at root {root}")
    return problems


def all_reduce_check(op: str) -> Callable[[Probe], list[str]]:
    def check(p: Probe) -> list[str]:
        data = p.sends(op)
        dist.all_reduce(data, op=REDUCTIONS[op][0])
        return expect(data, reduced(op, p.world_size), "result")

    return check


def check_gather(p: Probe) -> list[str]:
    problems = []
    for root in p.roots:
        slots = [p.empty() for _ in range(p.world_size)] if p.rank == root else None
        dist.gather(p.sends("gather"), gather_list=slots, dst=root)
        for source, slot in enumerate(slots or []):
            problems += expect(slot, p.truth("gather", source), f"at root {root}, from rank {source}")
    return problems


def check_all_gather(p: Probe) -> list[str]:
    slots = [p.empty() for _ in range(p.world_size)]
    dist.all_gather(slots, p.sends("all_gather"))
    return [problem for source, slot in enumerate(slots)
            for problem in expect(slot, p.truth("all_gather", source), f"from rank {source}")]


def check_scatter(p: Probe) -> list[str]:
    problems = []
    for root in p.roots:
        chunks = [p.sends("scatter", of_rank=rank) for rank in range(p.world_size)] if p.rank == root else None
        received = p.empty()
        dist.scatter(received, scatter_list=chunks, src=root)
        problems += expect(received, p.truth("scatter", p.rank), f"from root {root}")
    return problems


def check_barrier(p: Probe) -> list[str]:
    dist.barrier()
    return []


CHECKS: dict[str, Callable[[Probe], list[str]]] = {
    "send_recv": check_send_recv,
    "broadcast": check_broadcast,
    "reduce": check_reduce,
    **{op: all_reduce_check(op) for op in REDUCTIONS if op.startswith("all_reduce")},
    "gather": check_gather,
    "all_gather": check_all_gather,
    "scatter": check_scatter,
    "barrier": check_barrier,
}
SENT_BY_ROOT_ONLY = ("broadcast", "scatter")  # only the root's data is on the wire


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_checks(probe: Probe) -> tuple[list[Outcome], bool]:
    """Every check on this rank; False once a collective raised, after which ranks may be out of step."""
    outcomes = []
    for op, check in CHECKS.items():
        start = time.perf_counter()
        try:
            problems = check(probe)
            synchronize(probe.device)
        except Skipped as reason:
            outcomes.append(Outcome(probe.rank, op, SKIP, str(reason), 0.0))
        except Exception as error:  # a collective that raised or timed out
            outcomes.append(Outcome(probe.rank, op, FAIL, described(error), ms_since(start)))
            return outcomes, False
        else:
            status = FAIL if problems else OK
            outcomes.append(Outcome(probe.rank, op, status, "; ".join(problems), ms_since(start)))
    return outcomes, True


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
