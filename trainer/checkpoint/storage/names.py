"""What the folders of a checkpoint directory are called: a committed checkpoint, and what a save leaves while it
writes. The backends and the checkpoint manager make and read the names here only.

A checkpoint is ``step-<step>`` (8 digits or more), or ``step-<step>.<save>`` for a save committed in place (an
object store's, trainer.checkpoint.storage.base): <save> is 32 hex digits, the saving job's lease generation (8),
which only grows from one holder of the folder to the next, then the save's start in nanoseconds since the epoch
(16; another host's clock may differ, hence the generation first) and 8 random ones: of two saves of a step, the
one of the folder's newer holder, then the later one, sorts first. Anything whose name starts with
``TEMP_PREFIX`` never held a usable checkpoint, except one set aside while its step is saved again
(``set_aside``), which is put back if the new one never arrived.
"""

from __future__ import annotations

import re
import time
import uuid

__all__ = ["CHECKPOINT_NAME", "TEMP_PREFIX", "checkpoint_name", "in_place_name", "newest_first", "saved_in_place",
           "set_aside", "set_aside_from", "step_of", "temporary_name"]

CHECKPOINT_NAME = re.compile(r"\Astep-(\d{8,})(?:\.([0-9a-f]{32}))?\Z")
TEMP_PREFIX = ".tmp-"
_SET_ASIDE_PREFIX = f"{TEMP_PREFIX}replaced-"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    match = CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def newest_first(name: str) -> tuple[int, str]:
    """The sort key of checkpoint names, for ``reverse=True``: by step, then (a step saved twice in place) by the
    saving job's lease generation and the save's start."""
    match = CHECKPOINT_NAME.match(name)
    return (int(match.group(1)), match.group(2) or "") if match else (-1, "")


def saved_in_place(name: str) -> bool:
    """Whether ``name`` is a folder of its own for one save (``step-N.<save>``), committed by its manifest alone."""
    match = CHECKPOINT_NAME.match(name)
    return bool(match and match.group(2))


def in_place_name(name: str, generation: int) -> str:
    """The folder of its own of one save of checkpoint ``name`` by the job holding lease ``generation``."""
    return f"{name}.{generation:08x}{time.time_ns():016x}{uuid.uuid4().hex[:8]}"


def temporary_name(name: str) -> str:
    """A folder that a save of checkpoint ``name`` writes before it is renamed into place."""
    return f"{TEMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"


def set_aside(name: str) -> str:
    """Where checkpoint ``name`` is moved while a save of the same step takes its place."""
    return f"{_SET_ASIDE_PREFIX}{name}-{uuid.uuid4().hex[:8]}"


def set_aside_from(name: str) -> str | None:
    """The checkpoint a ``set_aside`` folder was, else None."""
    if not name.startswith(_SET_ASIDE_PREFIX):
        return None
    original = name.removeprefix(_SET_ASIDE_PREFIX).rsplit("-", 1)[0]
    return original if step_of(original) is not None else None
