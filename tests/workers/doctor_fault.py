"""The doctor with one rank lying in one operation: ``python -m tests.workers.doctor_fault RANK:OP [flags]``.

The doctor's self-test, kept out of the product: a Probe whose ``sends`` corrupts what rank RANK puts
on the wire in OP, so the tests can see the doctor report the rank and the operation. The corruption
changes the result whoever else contributes (a larger value would not change a MIN).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from trainer.doctor.checks import CHECKS, SENT_BY_ROOT_ONLY, Probe, roots
from trainer.doctor.cli import main
from trainer.launchers import identity_from_env


def corrupted(op: str, values: torch.Tensor) -> torch.Tensor:
    if op == "all_reduce_min":
        return values - 1e6
    if op == "all_reduce_product":
        return values * 3
    return values + 1e6


def faulty_probe(rank: int, op: str) -> type[Probe]:
    @dataclass(frozen=True)
    class Faulty(Probe):
        def sends(self, sent_op: str, of_rank: int | None = None) -> torch.Tensor:
            values = super().sends(sent_op, of_rank)
            return corrupted(sent_op, values) if (self.rank, sent_op) == (rank, op) else values
    return Faulty


def main_with_fault(argv: list[str]) -> int:
    rank_text, _, op = argv[0].partition(":")
    rank = int(rank_text)
    if op not in CHECKS or op == "barrier":
        raise SystemExit(f"{argv[0]}: OP must be one of {', '.join(o for o in CHECKS if o != 'barrier')}")
    world_size = identity_from_env(os.environ).world_size
    if op in SENT_BY_ROOT_ONLY and rank not in roots(world_size):
        raise SystemExit(f"only the root sends data in {op}, and the roots are ranks "
                         f"{' or '.join(map(str, roots(world_size)))}")
    return main(argv[1:], probe_type=faulty_probe(rank, op))


if __name__ == "__main__":
    sys.exit(main_with_fault(sys.argv[1:]))
