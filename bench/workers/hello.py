"""The floor of figure 8: ``torchrun ... -m bench.workers.hello OUT`` joins the group, runs one all-reduce, and
rank 0 writes the wall-clock time at which it completed. Nothing else: no trainer, no data, no model."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    ones = torch.ones(1)
    dist.all_reduce(ones)
    if dist.get_rank() == 0:
        Path(argv[0]).write_text(f"{time.time():.3f}\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
