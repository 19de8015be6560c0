"""One CUDA training run whose steady-state steps run under ``torch.cuda.set_sync_debug_mode("error")``.

``python -m tests.workers.sync_free_steps FIRST LAST TRAINER_FLAGS...``: from the FIRST stop vote (one per
optimizer step, trainer.distributed.StopVote) to the LAST, any operation that makes the CPU wait for the
GPU raises, and the run fails; the caller keeps log, evaluation and checkpoint steps outside that window.
Prints ``sync-free steps: N`` at the end.
"""

from __future__ import annotations

import sys

import torch

import trainer
from trainer.distributed import StopVote


def main(first: int, last: int, flags: list[str]) -> int:
    vote = StopVote.__call__
    checked = 0

    def watched_vote(self: StopVote, stop_here: bool) -> bool:
        nonlocal checked
        torch.cuda.set_sync_debug_mode("default")
        decided = vote(self, stop_here)
        if first <= self.votes < last:
            checked += 1
            torch.cuda.set_sync_debug_mode("error")
        return decided

    StopVote.__call__ = watched_vote  # type: ignore[method-assign]
    code = trainer.run(argv=flags)
    print(f"sync-free steps: {checked}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
