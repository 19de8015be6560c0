"""The trainer with a sharded save whose writers cannot report to rank 0: ``python -m tests.workers.broken_gather
[trainer flags]``. In the checkpoint writer thread, ``gather_object`` raises as gloo does when a peer is gone or
the side group's timeout passes; anywhere else it works. The save must fail on every rank, in one line."""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch.distributed as dist

import trainer

_gather_object = dist.gather_object


def _gather_that_fails_in_the_writer(*args: Any, **kwargs: Any) -> Any:
    if threading.current_thread().name == "checkpoint-writer":
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    return _gather_object(*args, **kwargs)


if __name__ == "__main__":
    dist.gather_object = _gather_that_fails_in_the_writer
    sys.exit(trainer.run())
