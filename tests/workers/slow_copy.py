"""The trainer with an asynchronous save whose deferred copy of the parameters starts late, as when the copy
competes with training for memory bandwidth or waits for a busy GPU.

``python -m tests.workers.slow_copy [trainer flags] --async-checkpoint``: each background write waits
SLOW_COPY_S seconds (default 0.3) before it copies the tensors it was handed (a sharded save's writer too,
before it writes anything). Training goes on meanwhile: only ``before_update`` keeps the next optimizer step
from changing the parameters before they are copied, and only the copies ``save()`` made keep anything else.
"""

from __future__ import annotations

import os
import sys
import time

import trainer
from trainer.checkpoint.writer import CheckpointWriter

_write_whole = CheckpointWriter.write_whole
_write_sharded = CheckpointWriter.write_sharded


def _late_copy(self: CheckpointWriter, *args: object) -> None:
    time.sleep(float(os.environ.get("SLOW_COPY_S", "0.3")))
    _write_whole(self, *args)  # type: ignore[arg-type]


def _late_sharded_write(self: CheckpointWriter, *args: object) -> None:
    time.sleep(float(os.environ.get("SLOW_COPY_S", "0.3")))
    _write_sharded(self, *args)  # type: ignore[arg-type]


if __name__ == "__main__":
    # Looked up on the writer when a save launches it (CheckpointManager.save): patched on the class.
    CheckpointWriter.write_whole = _late_copy  # type: ignore[method-assign]
    CheckpointWriter.write_sharded = _late_sharded_write  # type: ignore[method-assign]
    sys.exit(trainer.run())
