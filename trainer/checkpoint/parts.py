"""The training state as named parts: each component that owns state gives one, where it is built.

A part says its name, how to capture its value (plain types and tensors: checkpoints load with
``weights_only=True``) and how to restore it. The checkpoint saves the dict of parts. Adding state is one
``StatePart`` registered beside the component that owns it; the golden layout test
(tests/unit/test_checkpoint_layout.py) then fails until the layout is recorded, and demands a version bump
and an ``upgrade`` from what older checkpoints hold whenever a part's layout changes or a part is new.

Kinds: a ``REPLICATED`` part is the same on every rank and rank 0's is written; a ``PER_RANK`` part (the
random generators) is captured on every rank and saved as a list in rank order. A replicated part may hold
sharded tensors (DTensors, under --sync fsdp/hsdp): every rank's rows of them are written by DCP
(trainer.checkpoint.dcp_writer), and a part's ``template`` says what this run holds in its place, so that the
restore is given its tensors as this run holds them (trainer.checkpoint.shards.fit), whatever wrote them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from trainer.checkpoint.schema import HEADER, SHARDED_HEADER, TaskRecord, TrainingState
from trainer.checkpoint.shards import fit, markers
from trainer.errors import CheckpointError
from trainer.position import TrainingPosition

__all__ = ["PartKind", "RestoreContext", "StatePart", "StateParts", "add_run_parts"]


class PartKind(enum.Enum):
    REPLICATED = "replicated"
    PER_RANK = "per-rank"


@dataclass(frozen=True)
class RestoreContext:
    """What a part may need to know to restore itself in this run."""

    rank: int
    world_size: int
    saved_world_size: int
    seed: int
    step: int  # where the checkpoint stands: optimizer steps taken
    location: str  # the checkpoint's, for messages
    # A sharded checkpoint's rows, read on demand (trainer.checkpoint.shards.ShardSource; None: unsharded).
    shards: Any = None


def _nothing_deferred(path: str) -> bool:
    return False


@dataclass(frozen=True)
class StatePart:
    name: str
    capture: Callable[[], Any]
    # None: the part describes the run (its task, its config) and is read by trainer.resume's checks, not loaded.
    restore: Callable[[Any, RestoreContext], None] | None
    kind: PartKind = PartKind.REPLICATED
    version: int = 1  # of this part's layout; a checkpoint without the part holds version 0
    # The current version's value from an older one's (None for version 0: an older checkpoint lacks the part).
    upgrade: Callable[[int, Any], Any] | None = None
    # The oldest saved version ``upgrade`` reads (1: a checkpoint without the part is refused, not upgraded).
    oldest: int = 0
    # Its layout is someone else's (a torch state_dict, the flags, the task's options): the golden layout records
    # its type only, since torch or a new flag may change it without our format changing.
    opaque: bool = False
    # Which paths inside the value (``/<key>/...``) only the optimizer step changes: an asynchronous save copies
    # them while the next step computes its gradients (trainer.checkpoint.manager).
    changed_by_step_only: Callable[[str], bool] = _nothing_deferred
    # What this run holds in the part's place, for a saved value (the model's state_dict: its DTensors say which
    # rows this rank takes of each tensor). None: the saved value is restored as it is, its tensors whole.
    template: Callable[[Any], Any] | None = None


class StateParts:
    """The run's parts, in the order they were added; one name each."""

    def __init__(self) -> None:
        self._parts: dict[str, StatePart] = {}

    def add(self, part: StatePart) -> None:
        if part.name in self._parts or part.name in (*HEADER, *SHARDED_HEADER):
            raise ValueError(f"checkpoint part {part.name!r} is taken (parts: {', '.join(self._parts)}; the "
                             f"checkpoint's own entries: {', '.join((*HEADER, *SHARDED_HEADER))})")
        self._parts[part.name] = part

    def __iter__(self) -> Iterator[StatePart]:
        return iter(self._parts.values())

    def capture(self, world_size: int) -> TrainingState:
        """This rank's state; the checkpoint manager gathers the per-rank parts and adds the library versions."""
        return TrainingState({part.name: part.capture() for part in self}, world_size, {},
                             {part.name: part.version for part in self},
                             tuple(part.name for part in self if part.kind is PartKind.PER_RANK))

    def changed_by_step_only(self, path: str) -> bool:
        """For a path ``/<part>/...`` of the saved dict: whether only the optimizer step changes it."""
        name, _, inner = path.removeprefix("/").partition("/")
        part = self._parts.get(name)
        return part is not None and part.changed_by_step_only(f"/{inner}")

    def restore(self, state: TrainingState, context: RestoreContext) -> None:
        """Every part from the state: upgraded from an older version where its part knows how; a part the
        checkpoint lacks, or holds in a version this trainer cannot read, is refused in one line (never
        skipped: a skipped checkpoint would make --resume latest start afresh)."""
        restored: list[tuple[StatePart, Any, Any]] = []
        for part in self:
            if part.restore is None:
                continue
            value, saved_version = state.parts.get(part.name), state.part_version(part.name)
            if saved_version != part.version:
                value = self._upgraded(part, saved_version, value, context.location)
            restored.append((part, value, None if part.template is None else part.template(value)))
        source = context.shards
        if source is not None:  # every part's sharded tensors read at once (one collective pass under DCP)
            source.prepare([pair for _, value, template in restored for pair in markers(value, template)])
        for part, value, template in restored:
            if source is not None or template is not None:
                value = fit(value, template, source)
            part.restore(value, context)

    @staticmethod
    def _upgraded(part: StatePart, saved_version: int, value: Any, location: str) -> Any:
        held = f"part {part.name!r} at version {saved_version}" if saved_version else f"no part {part.name!r}"
        if saved_version > part.version or saved_version < part.oldest or part.upgrade is None:
            raise CheckpointError(f"checkpoint {location} holds {held}, and this trainer reads version "
                                  f"{part.version} only; resume it with the trainer release that wrote it, or use "
                                  f"another --checkpoint-dir or --resume none (the checkpoints are kept)")
        return part.upgrade(saved_version, value)


def add_run_parts(parts: StateParts, position: TrainingPosition, task: TaskRecord, config: dict[str, Any]) -> None:
    """The checkpoint's parts a run owns (trainer.loop adds them): where training stands, and what describes
    the run (the task and the trainer's sections, redacted), which trainer.resume compares before anything is
    restored."""
    def restore_position(saved: dict[str, Any], _: RestoreContext) -> None:
        for name, value in TrainingPosition.from_dict(saved).to_dict().items():
            setattr(position, name, value)

    parts.add(StatePart("position", position.to_dict, restore_position))
    parts.add(StatePart("task", lambda: asdict(task), None))
    parts.add(StatePart("config", lambda: config, None, opaque=True))  # its layout is the flags'
