"""The trainer with a fault on rank 1 alone: ``python -m tests.workers.one_rank_fails FAULT [trainer flags]``.

  load-metadata  rank 1 cannot read a sharded checkpoint's .metadata (its storage answers with an I/O error) while
                 rank 0 can: every rank must stop in one line naming it, not wait in DCP's collective read
  save-before    rank 1's copies for a sharded save fail before it writes anything (a CUDA error): every rank must
                 fail the save in one line naming it, not wait in DCP's collectives until the save's timeout
  other-state    rank 1 reads another state.pt than rank 0 (of the same size: a node's own disk where the others'
                 is shared): every rank must stop in one line saying so, not train from other values
"""

from __future__ import annotations

import os
import sys
from typing import Any

import trainer
from trainer.checkpoint import dcp_metadata, writer
from trainer.checkpoint.reading import InvalidCheckpoint


def _inject(fault: str) -> None:
    if fault == "load-metadata":
        real_read = dcp_metadata.checked_read

        def checked_read(storage: Any, name: str, filename: str, manifest: Any) -> bytes:
            if filename == ".metadata":
                raise InvalidCheckpoint(".metadata unreadable (Input/output error)")
            return real_read(storage, name, filename, manifest)

        dcp_metadata.checked_read = checked_read  # type: ignore[assignment]
    elif fault == "save-before":
        def on_writer_thread(self: Any, copies: Any) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

        writer.CheckpointWriter._on_writer_thread = on_writer_thread  # type: ignore[method-assign]
    elif fault == "other-state":
        from trainer.checkpoint.storage.local import LocalStorage

        real_range = LocalStorage.read_range

        def read_range(self: Any, name: str, filename: str, offset: int, length: int) -> bytes:
            data = real_range(self, name, filename, offset, length)
            return bytes(byte ^ 0xFF for byte in data[:64]) + data[64:] if filename == "state.pt" else data

        LocalStorage.read_range = read_range  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    fault = sys.argv.pop(1)
    if os.environ.get("RANK") == "1":
        _inject(fault)
    sys.exit(trainer.run())
