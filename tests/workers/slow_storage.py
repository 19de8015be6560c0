"""The trainer with checkpoints on storage that writes slowly, for tests of long saves.

``python -m tests.workers.slow_storage [trainer flags] --checkpoint-dir slowfile:///path``: the folder is
an ordinary local one reached through fsspec, except that opening each ``state.pt`` (or each file whose name ends
with SLOW_FILE) for writing after the first SLOW_AFTER (default 0) takes SLOW_SAVE_S seconds (default 6), announced
on stderr as ``slow write started``.
With SLOW_ONCE (a file's path), only one such write is slow among all the processes that share it (the first
to create the file): an elastic job's restarted workers save at full speed.
"""

from __future__ import annotations

import os
import sys
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem

import trainer


class SlowFileSystem(LocalFileSystem):
    protocol = ("slowfile",)
    fast_saves_left = int(os.environ.get("SLOW_AFTER", "0"))

    @classmethod
    def _strip_protocol(cls, path):  # type: ignore[no-untyped-def] - fsspec's signature
        return super()._strip_protocol(str(path).removeprefix("slowfile://"))

    def _open(self, path, mode="rb", **kwargs):  # type: ignore[no-untyped-def]
        handle = super()._open(path, mode, **kwargs)
        if "w" in mode and str(path).endswith(os.environ.get("SLOW_FILE", "/state.pt")):
            if SlowFileSystem.fast_saves_left > 0:
                SlowFileSystem.fast_saves_left -= 1
            elif first_slow_write():
                print("slow write started", file=sys.stderr, flush=True)
                time.sleep(float(os.environ.get("SLOW_SAVE_S", "6")))
        return handle


def first_slow_write() -> bool:
    once = os.environ.get("SLOW_ONCE")
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


if __name__ == "__main__":
    fsspec.register_implementation("slowfile", SlowFileSystem, clobber=True)
    sys.exit(trainer.run())
