"""The flight recorder: each rank keeps its last collectives (op, sizes, state, stack), and when one times out
the trainer writes them out, so that ``torchfrtrace`` can name the first collective a rank never joined.

PyTorch records for gloo and NCCL alike (``TORCH_FR_BUFFER_SIZE``; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` before
2.7). NCCL's watchdog dumps on its own timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``), which the trainer places after
its own diagnosis (trainer.distributed.nccl_timeout_s); so the trainer dumps every rank's record itself when
it diagnoses a timeout or a stuck rank, on any backend. One file per rank, ``OUTPUT_DIR/flight-recorder/rank-N``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import torch

__all__ = ["FOLDER", "PREFIX", "apply_recorder_environment", "dump_flight_recorder", "recorder_environment"]

FOLDER = "flight-recorder"
PREFIX = "rank-"
ENTRIES = "2000"  # collectives kept per rank: a few steps' worth for the largest models


def recorder_environment(environ: Mapping[str, str], output_dir: str) -> dict[str, str]:
    """The recorder's settings this run adds, each only where the user has not set it (theirs win)."""
    dump = str(Path(output_dir).resolve() / FOLDER / PREFIX)
    wanted = {"TORCH_FR_BUFFER_SIZE": ENTRIES, "TORCH_NCCL_TRACE_BUFFER_SIZE": ENTRIES,
              "TORCH_FR_DUMP_TEMP_FILE": dump, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump}
    return {name: value for name, value in wanted.items() if name not in environ}


def apply_recorder_environment(environ: MutableMapping[str, str], output_dir: str) -> dict[str, str]:
    """Set the recorder's settings before the process group exists (read when it is created); the dump folder
    is made now, best effort: an output folder that cannot be written fails later, clearly."""
    added = recorder_environment(environ, output_dir)
    environ.update(added)
    with contextlib.suppress(OSError):
        dump_prefix(environ).parent.mkdir(parents=True, exist_ok=True)
    return added


def dump_prefix(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("TORCH_FR_DUMP_TEMP_FILE") or environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or PREFIX)


def dump_flight_recorder(environ: Mapping[str, str], rank: int) -> Path | None:
    """Write this rank's record where NCCL's own dump would go (prefix + rank); None if there is no recorder or
    it cannot be written (the diagnosis goes on without it)."""
    c10d = torch._C._distributed_c10d
    dumper = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dumper is None:
        return None
    target = Path(f"{dump_prefix(environ)}{rank}")
    try:
        record = dumper()
        target.parent.mkdir(parents=True, exist_ok=True)
        draft = target.with_name(f".{target.name}.partial")
        draft.write_bytes(record)
        os.replace(draft, target)  # a reader (torchfrtrace) never sees half a dump
    except (RuntimeError, OSError):
        return None
    return target


def reading_advice(folder: Path) -> str:
    return (f"each rank's last collectives are in {folder}/{PREFIX}N (compare them with `torchfrtrace {folder} -p "
            f"{PREFIX}`: it names the first collective a rank never joined)")
