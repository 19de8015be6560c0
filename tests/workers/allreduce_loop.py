"""A worker of an elastic job that only all-reduces, forever, 5 times a second: it fails its next collective once
a peer is lost (exit 1, one line), so its agent re-forms the job. ``python -m tests.workers.allreduce_loop``."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")
    print(f"all-reducing at world size {dist.get_world_size()}", flush=True)
    try:
        while True:
            dist.all_reduce(torch.ones(1))
            time.sleep(0.2)
    except RuntimeError as error:  # gloo's: the peer is gone
        print(f"lost a peer: {str(error).splitlines()[0][:200]}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
