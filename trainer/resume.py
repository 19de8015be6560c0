"""What a resume may change: each setting's ResumeRule (trainer.options), applied to a checkpoint.

  allowed   more or fewer epochs, --max-steps, logging and output, checkpoint settings, timeouts,
            device and backend, DataLoader workers, the evaluation batch size, the gradient-sync method,
            the world size (the sample order is global), and task options marked so (--data-dir)
  flagged   what changes the training itself: learning rate and schedule, batch size, gradient
            accumulation, precision, seed, SyncBN, --max-train-samples, and task options marked so;
            each must be named in --allow-resume-change
  refused   another task, the optimizer, and the task's options that define what is trained (model,
            dataset): the checkpoint is of something else
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from trainer.checkpoint import LoadedCheckpoint
from trainer.config import SECTIONS, Config
from trainer.errors import CheckpointError
from trainer.options import ResumeRule, fields_of, flag_of, resume_rule
from trainer.redact import redacted
from trainer.task import RunTask

FIX = "use another --checkpoint-dir, or --resume none to start afresh (the checkpoints are kept)"


def check_resume(loaded: LoadedCheckpoint, config: Config, task: RunTask) -> list[str]:
    """The changes this resume makes (to log); CheckpointError if one is refused or not allowed by flag."""
    state = loaded.state
    if state.task.name != task.name:
        raise CheckpointError(f"checkpoint {loaded.location} is of task {state.task.name!r} ({state.task.source}) but "
                              f"this run trains {task.name!r}; pass --task {state.task.source}, or {FIX}")
    allowed = config.checkpoint.allowed_changes()
    changes: list[tuple[str, Any, Any, ResumeRule]] = []
    for section, kind in SECTIONS.items():
        changes += _differences(state.config.get(section, {}), getattr(config, section), kind)
    changes += _differences(state.task.options, task.options, type(task.options))
    if state.config.get("train", {}).get("global_batch_size") and config.train.global_batch_size:
        # Where --global-batch-size sets each rank's micro-batch, before and now, --batch-size was never used.
        changes = [change for change in changes if change[0] != "batch_size"]
    refused = [change for change in changes if change[3] is ResumeRule.REFUSE]
    if refused:
        name, saved, now, _ = refused[0]
        raise CheckpointError(f"checkpoint {loaded.location} was trained with {flag_of(name)} {saved} and this run "
                              f"asks for {now}, which a resume cannot change; pass {flag_of(name)} {saved}, or {FIX}")
    unflagged = [change for change in changes if change[3] is ResumeRule.FLAG and change[0] not in allowed]
    if unflagged:
        listed = ", ".join(f"{flag_of(name)} {saved} -> {now}" for name, saved, now, _ in unflagged)
        names = ",".join(name for name, *_ in unflagged)
        raise CheckpointError(f"checkpoint {loaded.location}: this run changes {listed}, which changes the "
                              f"training from here on; to resume so, pass --allow-resume-change {names}; or keep "
                              f"the checkpoint's values, or {FIX}")
    return [f"{flag_of(name)} {saved} -> {now}" for name, saved, now, _ in changes]


def _differences(saved: Mapping[str, Any], current: Any, kind: type) -> list[tuple[str, Any, Any, ResumeRule]]:
    """(name, saved value, current value, rule) for each field whose value changed. A field the checkpoint does
    not have (added since) was trained with that field's default: the behaviour before it existed."""
    if not dataclasses.is_dataclass(current):
        return []
    changed = []
    for field in fields_of(kind):
        if resume_rule(field) is ResumeRule.IGNORE:
            continue
        # Checkpoints hold configs redacted (no URL's password or token): compare with this run's, redacted.
        now = redacted(getattr(current, field.name))
        was = saved.get(field.name, field.default)
        if was is not dataclasses.MISSING and was != now:
            changed.append((field.name, was, now, resume_rule(field)))
    return changed
