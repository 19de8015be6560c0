"""Ray's checkpoints under ddp-train-ray: each a folder in the run holding only where the trainer's checkpoint is,
Ray's own to delete (it keeps the newest)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

__all__ = ["POINTERS", "POINTER_FILE", "pointed_at", "pointer_target", "write_pointer"]

POINTERS, POINTER_FILE = "ray-checkpoints", "checkpoint.json"


def write_pointer(run_folder: Path, location: str, step: int) -> Path:
    """Ray's checkpoint for the trainer's checkpoint at ``location``. Not the trainer's folder itself: the trainer
    prunes its checkpoints (--keep-last), and Ray refuses to start a run again whose list names a folder that is
    gone ("a reference to a checkpoint that does not exist anymore")."""
    # A name of its own each time: two reports may name one checkpoint (an epoch-end save at the step of a
    # --checkpoint-every one replaces it), and Ray deletes the older report's folder as it registers the newer.
    pointer = run_folder / POINTERS / f"{Path(location).name}.{uuid.uuid4().hex[:8]}"
    pointer.mkdir(parents=True, exist_ok=True)
    (pointer / POINTER_FILE).write_text(json.dumps({"checkpoint": location, "step": step}))
    return pointer


def pointed_at(pointer: str | Path) -> str:
    """The trainer's checkpoint a pointer of Ray's names."""
    return str(json.loads((Path(pointer) / POINTER_FILE).read_text())["checkpoint"])


def pointer_target(pointer: str) -> str:
    """pointed_at for a message: a pointer that cannot be read is named as such, never an error."""
    try:
        return pointed_at(pointer)
    except (OSError, ValueError, KeyError, TypeError):
        return f"(unreadable: {pointer})"
