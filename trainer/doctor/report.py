"""What the doctor tells people: rank 0's tables on stdout, the failures on every rank, a JSON report."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from trainer.distributed import Runtime
from trainer.doctor.bandwidth import Bandwidth
from trainer.doctor.checks import FAIL, NOT_RUN, OK, SKIP, Outcome
from trainer.errors import ConfigError
from trainer.launchers import DistIdentity

PROG = "ddp-doctor"


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
                 bandwidths: Sequence[Bandwidth], iterations: int) -> None:
    print_tables(runtime.identity, f"backend {runtime.backend}", environments, outcomes)
    if bandwidths:
        print(f"\nall_reduce bandwidth: float32, {iterations} iteration(s) per size, slowest rank; "
              f"busbw = algbw x 2(n-1)/n; MB = 10^6 bytes")
        print(table(("size_MB", "time_ms", "algbw_GB/s", "busbw_GB/s"),
                    [[f"{b.size_mb:g}", f"{b.time_ms:.3f}", f"{b.algbw_gbps:.3f}", f"{b.busbw_gbps:.3f}"]
                     for b in bandwidths]))


def print_tables(identity: DistIdentity, group: str, environments: Sequence[Mapping[str, object]],
                 outcomes: Sequence[Outcome]) -> None:
    """Who the ranks are and what each check found; ``group``: its backend, or why it was not joined."""
    # Hosts as they answered, not the launcher's node count: plain RANK/WORLD_SIZE launches cannot know it.
    hosts = len({env["host"] for env in environments})
    print(f"\n{PROG}: {identity.world_size} rank(s) on {hosts} host(s), {group}, "
          f"master {identity.master_addr}:{identity.master_port}, torch {torch.__version__}")
    columns = ("rank", "node", "local_rank", "host", "launcher", "device")
    print(table(columns, [[str(env[column]) for column in columns] for env in environments]))
    print()
    print(table(("rank", "op", "result", "time_ms", "detail"), check_rows(outcomes, identity.world_size)))


def write_json(path: str, world_size: int, backend: str | None, environments: Sequence[Mapping[str, object]],
               outcomes: Sequence[Outcome], bandwidths: Sequence[Bandwidth], ok: bool) -> None:
    """``backend``: None where the group was not joined."""
    report: dict[str, Any] = {
        "ok": ok, "world_size": world_size, "backend": backend,
        "torch": torch.__version__, "ranks": list(environments), "checks": [asdict(outcome) for outcome in outcomes],
        "bandwidth": [asdict(bandwidth) for bandwidth in bandwidths],
    }
    try:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    except OSError as error:
        raise ConfigError(f"--json {path}: cannot write the report ({error.strerror})") from None
