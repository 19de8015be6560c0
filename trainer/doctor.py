"""Preflight for a new cluster: who each rank is, whether every collective is right, how fast all-reduce is.

Run it first, under the launcher the trainer will use (flags as for the trainer's distributed section):

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m trainer.doctor
    RANK=0 WORLD_SIZE=2 MASTER_ADDR=host MASTER_PORT=29500 ddp-doctor      # Compose, PyTorchJob
    python -m trainer.doctor                                                 # one process

Each rank prints who it is before it joins the group, so a rendezvous that never completes shows who
arrived. Every rank then runs every check with values chosen so that a value from the wrong rank, the
wrong slot or the wrong operation shows; rank 0 prints the results and the bandwidth table. Exit
status: 0 every check passed; 1 a check failed (the message names the rank and the operation); 2 bad
flags or launcher environment; 3 the master was not reachable.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from functools import reduce
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import DistConfig
from trainer.distributed import Runtime, choose_backend, choose_device, process_group
from trainer.env import identity_from_env
from trainer.errors import EXIT_FAILURE, EXIT_OK, ConfigError, UserError

PROG = "ddp-doctor"
WIDTH = 4  # elements per check tensor: a shifted, truncated or mixed-up buffer shows in at least one
OK, FAIL, SKIP, NOT_RUN = "ok", "FAIL", "skip", "not run"
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0  # a preflight should fail within a minute, not the trainer's ten

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
class Fault:
    """Self-test: ``rank`` sends wrong data in ``op``, to see the doctor report it."""

    rank: int
    op: str


@dataclass(frozen=True)
class Outcome:
    rank: int
    op: str
    status: str
    detail: str
    time_ms: float


@dataclass(frozen=True)
class Bandwidth:
    """One all-reduce size, timed on the slowest rank; bus bandwidth as nccl-tests define it."""

    size_mb: float
    time_ms: float
    algbw_gbps: float
    busbw_gbps: float


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


def corrupted(op: str, values: list[float]) -> list[float]:
    """Wrong values that change the op's result whoever else contributes (a larger value would not change a MIN)."""
    if op == "all_reduce_min":
        return [value - 1e6 for value in values]
    if op == "all_reduce_product":
        return [value * 3 for value in values]
    return [value + 1e6 for value in values]


@dataclass(frozen=True)
class Probe:
    """One rank's side of the checks."""

    rank: int
    world_size: int
    device: torch.device
    fault: Fault | None = None

    @property
    def roots(self) -> list[int]:
        return roots(self.world_size)

    def truth(self, op: str, of_rank: int) -> list[float]:
        return contribution(op, of_rank, self.world_size)

    def sends(self, op: str, of_rank: int | None = None) -> torch.Tensor:
        """The tensor this rank puts on the wire: its own contribution, or another rank's (scatter)."""
        values = self.truth(op, self.rank if of_rank is None else of_rank)
        if self.fault == Fault(self.rank, op):
            values = corrupted(op, values)
        return torch.tensor(values, dtype=torch.float64, device=self.device)

    def empty(self) -> torch.Tensor:
        return torch.full((WIDTH,), float("nan"), dtype=torch.float64, device=self.device)


def roots(world_size: int) -> list[int]:
    """Rooted operations run from rank 0 and from the last rank: a root other than 0 takes other paths."""
    return sorted({0, world_size - 1})


def expect(got: torch.Tensor, want: list[float], where: str) -> list[str]:
    values = got.tolist()
    return [] if values == want else [f"{where}: expected {_numbers(want)}, got {_numbers(values)}"]


def _numbers(values: list[float]) -> str:
    return "[" + ", ".join(f"{value:.12g}" for value in values) + "]"


# Each check returns what it found wrong and never stops early on a wrong value: a rank that skipped
# a collective the others still run (the second root, say) would pair its next one with theirs.


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
INJECTABLE = tuple(op for op in CHECKS if op != "barrier")  # a barrier carries no data to corrupt
SENT_BY_ROOT_ONLY = ("broadcast", "scatter")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def run_checks(probe: Probe) -> tuple[list[Outcome], bool]:
    """Every check on this rank; False once a collective raised, after which ranks may be out of step."""
    outcomes = []
    for op, check in CHECKS.items():
        start = time.perf_counter()
        try:
            problems = check(probe)
            _synchronize(probe.device)
        except Skipped as reason:
            outcomes.append(Outcome(probe.rank, op, SKIP, str(reason), 0.0))
        except Exception as error:  # a collective that raised or timed out
            outcomes.append(Outcome(probe.rank, op, FAIL, _first_line(error), _ms_since(start)))
            return outcomes, False
        else:
            status = FAIL if problems else OK
            outcomes.append(Outcome(probe.rank, op, status, "; ".join(problems), _ms_since(start)))
    return outcomes, True


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def measure_bandwidth(probe: Probe, size_mb: float, iterations: int) -> tuple[Bandwidth, Outcome]:
    """Time float32 all-reduces of ``size_mb`` (10^6 bytes), then check one such all-reduce's values."""
    n = probe.world_size
    numel = max(1, round(size_mb * 1e6 / 4))
    data = torch.zeros(numel, dtype=torch.float32, device=probe.device)
    dist.all_reduce(data)  # warm-up: the first call of a size sets up buffers and connections
    _synchronize(probe.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(data)
    _synchronize(probe.device)
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
        except Exception as error:  # a collective that raised or timed out: stop here, as in run_checks
            outcomes.append(Outcome(probe.rank, f"all_reduce_sum {size_mb:g} MB", FAIL, _first_line(error), 0.0))
            break
        bandwidths.append(bandwidth)
        outcomes.append(outcome)
    return bandwidths, outcomes


def describe_device(device: torch.device) -> str:
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [header, *rows]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def check_rows(outcomes: Sequence[Outcome], world_size: int) -> list[list[str]]:
    """One row per operation that passed everywhere; one per rank where it did not."""
    by_op: dict[str, dict[int, Outcome]] = {}
    for outcome in outcomes:
        by_op.setdefault(outcome.op, {})[outcome.rank] = outcome
    rows = []
    for op, by_rank in by_op.items():
        statuses = {outcome.status for outcome in by_rank.values()}
        if len(by_rank) == world_size and statuses in ({OK}, {SKIP}):
            slowest = max(by_rank.values(), key=lambda outcome: outcome.time_ms)
            rows.append(["all", op, slowest.status, f"{slowest.time_ms:.2f}", slowest.detail])
            continue
        for rank in range(world_size):
            outcome = by_rank.get(rank)
            if outcome is None:
                rows.append([str(rank), op, NOT_RUN, "", "stopped after an earlier error"])
            elif outcome.status != OK:
                rows.append([str(rank), op, outcome.status, f"{outcome.time_ms:.2f}", outcome.detail])
    return rows


def failure_summary(outcomes: Sequence[Outcome]) -> str:
    """``op on ranks a, b (first detail)`` for each failed operation."""
    failed: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        if outcome.status == FAIL:
            failed.setdefault(outcome.op, []).append(outcome)
    parts = []
    for op, group in failed.items():
        ranks = ", ".join(str(outcome.rank) for outcome in group)
        parts.append(f"{op} on rank{'s' if len(group) > 1 else ''} {ranks} ({group[0].detail})")
    return "; ".join(parts)


def print_report(runtime: Runtime, environments: Sequence[Mapping[str, object]], outcomes: Sequence[Outcome],
                 bandwidths: Sequence[Bandwidth], iterations: int, fault: Fault | None) -> None:
    identity = runtime.identity
    # Hosts as they answered, not the launcher's node count: plain RANK/WORLD_SIZE launches cannot know it.
    hosts = len({env["host"] for env in environments})
    print(f"\n{PROG}: {identity.world_size} rank(s) on {hosts} host(s), backend {runtime.backend}, "
          f"master {identity.master_addr}:{identity.master_port}, torch {torch.__version__}")
    if fault is not None:
        print(f"{PROG}: self-test: rank {fault.rank} sends wrong data in {fault.op} (--inject-fault)")
    columns = ("rank", "node", "local_rank", "host", "launcher", "device")
    print(table(columns, [[str(env[column]) for column in columns] for env in environments]))
    print()
    print(table(("rank", "op", "result", "time_ms", "detail"), check_rows(outcomes, identity.world_size)))
    if bandwidths:
        print(f"\nall_reduce bandwidth: float32, {iterations} iteration(s) per size, slowest rank; "
              f"busbw = algbw x 2(n-1)/n; MB = 10^6 bytes")
        print(table(("size_MB", "time_ms", "algbw_GB/s", "busbw_GB/s"),
                    [[f"{b.size_mb:g}", f"{b.time_ms:.3f}", f"{b.algbw_gbps:.3f}", f"{b.busbw_gbps:.3f}"]
                     for b in bandwidths]))


def diagnose(runtime: Runtime, options: argparse.Namespace) -> int:
    """Run the checks and the bandwidth test on this rank, then agree with the others on the verdict."""
    identity = runtime.identity
    probe = Probe(identity.rank, identity.world_size, runtime.device, options.inject_fault)
    outcomes, in_step = run_checks(probe)
    bandwidths: list[Bandwidth] = []
    if in_step:
        bandwidths, measured = run_bandwidth(probe, options.sizes_mb, options.iterations)
        outcomes += measured
    environment = {"rank": identity.rank, "node": identity.node_rank, "local_rank": identity.local_rank,
                   "host": identity.hostname, "launcher": identity.launcher,
                   "device": describe_device(runtime.device)}
    shared: list[object] = [None] * identity.world_size
    try:
        dist.all_gather_object(shared, (environment, [asdict(outcome) for outcome in outcomes]))
    except Exception as error:  # the group broke down: this rank can only speak for itself
        local = failure_summary(outcomes)
        message = (f"FAILED: {local}; the other ranks' results are unavailable" if local else
                   f"FAILED: every check passed here, but the other ranks' results could not be collected "
                   f"({_first_line(error)})")
        print(f"{PROG}: rank {identity.rank}: {message}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    environments = [env for env, _ in shared]
    everyone = [Outcome(**outcome) for _, rank_outcomes in shared for outcome in rank_outcomes]
    failures = failure_summary(everyone)
    if identity.is_main:
        print_report(runtime, environments, everyone, bandwidths, options.iterations, options.inject_fault)
        if options.json:
            report = {
                "ok": not failures, "world_size": identity.world_size, "backend": runtime.backend,
                "torch": torch.__version__, "injected_fault": asdict(options.inject_fault) if options.inject_fault
                else None, "ranks": environments, "checks": [asdict(outcome) for outcome in everyone],
                "bandwidth": [asdict(bandwidth) for bandwidth in bandwidths],
            }
            try:
                Path(options.json).write_text(json.dumps(report, indent=2) + "\n")
            except OSError as error:
                raise ConfigError(f"--json {options.json}: cannot write the report ({error.strerror})") from None
    sys.stdout.flush()
    if failures:
        print(f"{PROG}: rank {identity.rank}: FAILED: {failures}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    if identity.is_main:
        print(f"\n{PROG}: every check passed on {identity.world_size} rank(s)", flush=True)
    return EXIT_OK


def _fault(text: str) -> Fault:
    rank, _, op = text.partition(":")
    if not rank.strip().isdigit() or op not in INJECTABLE:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RANK:OP, OP one of {', '.join(INJECTABLE)}")
    return Fault(int(rank), op)


def _sizes(text: str) -> list[float]:
    try:
        sizes = [float(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive sizes in MB separated by commas, e.g. 0.25,1,16")
    return sizes


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Preflight of a distributed setup: every rank's environment, every collective's "
        "result, all-reduce bandwidth. Run it under the launcher the trainer will use.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    helps = {f.name: f.metadata["help"] for f in fields(DistConfig)}
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help=helps["device"])
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"), help=helps["backend"])
    parser.add_argument("--rendezvous-timeout-s", type=float, default=DistConfig.rendezvous_timeout_s,
                        help=helps["rendezvous_timeout_s"])
    parser.add_argument("--collective-timeout-s", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S,
                        help=helps["collective_timeout_s"])
    parser.add_argument("--sizes-mb", type=_sizes, default="0.25,1,16",
                        help="all-reduce sizes to time, in MB (10^6 bytes), comma-separated")
    parser.add_argument("--iterations", type=_positive_int, default=5, help="timed all-reduces per size")
    parser.add_argument("--json", default="", metavar="PATH", help="rank 0 also writes the full report to this file")
    parser.add_argument("--inject-fault", type=_fault, default=None, metavar="RANK:OP",
                        help="self-test of the doctor: RANK sends wrong data in OP, which must then be reported "
                        f"as failed (OP: {', '.join(INJECTABLE)})")
    return parser


def _validate(options: argparse.Namespace, world_size: int, is_main: bool) -> None:
    fault = options.inject_fault
    if fault is not None:
        if fault.rank >= world_size:
            raise ConfigError(f"--inject-fault {fault.rank}:{fault.op}: there is no rank {fault.rank} among "
                              f"{world_size}; choose a rank in 0..{world_size - 1}")
        if fault.op in SENT_BY_ROOT_ONLY and fault.rank not in roots(world_size):
            choices = " or ".join(map(str, roots(world_size)))
            raise ConfigError(f"--inject-fault {fault.rank}:{fault.op}: only the root sends data in {fault.op}, and "
                              f"the roots are ranks {choices}; choose one of them")
    if is_main and options.json and not Path(options.json).resolve().parent.is_dir():
        raise ConfigError(f"--json {options.json}: folder {Path(options.json).resolve().parent} does not exist")


def run(options: argparse.Namespace, environ: Mapping[str, str]) -> int:
    config = DistConfig(device=options.device, backend=options.backend,
                        rendezvous_timeout_s=options.rendezvous_timeout_s,
                        collective_timeout_s=options.collective_timeout_s)
    identity = identity_from_env(environ)
    _validate(options, identity.world_size, identity.is_main)
    device = choose_device(config, identity)
    # Printed before joining: when the rendezvous never completes, these lines show who arrived.
    print(f"{PROG}: {identity.describe()}; device {describe_device(device)}, "
          f"backend {choose_backend(config, device)}: joining the group", flush=True)
    with process_group(config, identity, device) as runtime:
        return diagnose(runtime, options)


def main(argv: Sequence[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    try:
        return run(options, os.environ)
    except UserError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
