"""One rank of a real training run that records, in order, each stop vote and each host read.

``python -m tests.workers.device_waits EVENTS_FILE TRAINER_FLAGS...``: trains as ``ddp-train`` would and
writes this rank's events to EVENTS_FILE.rankN as a JSON list of "vote" and "read" entries.

A host read is an operation that hands a tensor's value to Python (``.item()``, ``bool()``, ``float()``,
``nonzero``...): on a GPU each one makes the CPU wait until the device has caught up, so that it can no longer
queue the next step's work ahead. They are counted where PyTorch dispatches them (a TorchDispatchMode), so a
read anywhere in the loop, the trainer's or a library's, is seen. The stop vote's own read of its CPU ballot
is counted as the vote (trainer.distributed.StopVote): it waits for no device.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

import trainer
from trainer.distributed import StopVote

READS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.nonzero.default",
         "aten.equal.default"}


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.in_vote = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func) in READS and not self.in_vote:
            self.events.append("read")
        return func(*args, **(kwargs or {}))


def main(events_file: str, flags: list[str]) -> int:
    counter = HostReads()
    vote = StopVote.__call__

    def counted_vote(self: StopVote, stop_here: bool) -> bool:
        counter.events.append("vote")
        counter.in_vote = True
        try:
            return vote(self, stop_here)
        finally:
            counter.in_vote = False

    StopVote.__call__ = counted_vote  # type: ignore[method-assign]
    with counter:
        code = trainer.run(argv=flags)
    Path(f"{events_file}.rank{os.environ['RANK']}").write_text(json.dumps(counter.events))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
