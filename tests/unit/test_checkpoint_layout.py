"""The checkpoint's layout is recorded (tests/fixtures/checkpoint-layout.json): a part added or changed without a
version bump and an upgrade from what older checkpoints hold fails here, before any checkpoint is lost to it."""

from __future__ import annotations

import pytest

from tests.support.checkpoint_layout import describe, recorded, trainer_parts
from trainer.checkpoint import FORMAT, RestoreContext, StatePart, StateParts, TrainingState
from trainer.checkpoint.schema import READABLE
from trainer.errors import CheckpointError

RECORD = "then record the layout: python -m tests.support.checkpoint_layout"


def layout_problems(parts: StateParts, golden: dict) -> list[str]:
    """What a change of the saved layout lacks, part by part (empty: nothing, or only the record to update)."""
    current = describe(parts)
    problems = []
    if current["header"] != golden["header"] and current["format"] == golden["format"]:
        problems.append(f"the file's own entries changed at format {FORMAT}: bump FORMAT in "
                        f"trainer/checkpoint/schema.py and migrate format {FORMAT} there")
    if golden["format"] != current["format"] and golden["format"] not in READABLE:
        problems.append(f"format {golden['format']} is no longer readable: keep it in READABLE with a migration")
    for part in parts:
        saved = golden["parts"].get(part.name)
        saved_version = 0 if saved is None else saved["version"]
        layout = current["parts"][part.name]
        if saved is not None and saved_version == part.version and saved != layout:
            problems.append(f"part {part.name!r} is saved in another layout at the same version {part.version}: bump "
                            f"its version and give it an upgrade from version {saved_version}")
        elif saved_version != part.version and part.upgrade is None:
            what = "is new: older checkpoints lack it" if saved is None else f"went {saved_version} -> {part.version}"
            problems.append(f"part {part.name!r} {what}; give it an upgrade from version {saved_version}")
    return problems


def test_the_saved_layout_is_the_recorded_one_or_each_change_has_a_version_bump_and_an_upgrade():
    parts, golden = trainer_parts(), recorded()
    problems = layout_problems(parts, golden)
    assert not problems, "; ".join(problems)
    assert describe(parts) == golden, f"the layout changed with its version bumps and upgrades; {RECORD}"


def test_the_check_catches_a_field_added_without_a_bump_and_a_new_part_without_an_upgrade():
    """The data-losing recipe of before: a field added to the position (or a new part) and nothing else."""
    golden = recorded()
    grown = StateParts()
    for part in trainer_parts():
        grown.add(part if part.name != "position" else StatePart(
            "position", lambda part=part: {**part.capture(), "best": 0.0}, part.restore))
    assert layout_problems(grown, golden) == [
        "part 'position' is saved in another layout at the same version 1: bump its version and give it an upgrade "
        "from version 1"]
    added = trainer_parts()
    added.add(StatePart("best", lambda: {"accuracy": 0.0}, lambda saved, context: None))
    assert layout_problems(added, golden) == [
        "part 'best' is new: older checkpoints lack it; give it an upgrade from version 0"]
    added = trainer_parts()
    added.add(StatePart("best", lambda: {"accuracy": 0.0}, lambda saved, context: None,
                        upgrade=lambda version, saved: {"accuracy": float("nan")}))
    assert layout_problems(added, golden) == []  # what remains is to record it


def context() -> RestoreContext:
    return RestoreContext(rank=0, world_size=1, saved_world_size=1, seed=0, step=3, location="ckpt/step-3")


def test_a_part_saved_at_an_older_version_is_upgraded_and_a_missing_one_without_upgrade_is_refused_in_one_line():
    restored = {}
    parts = StateParts()
    parts.add(StatePart("counts", lambda: {"seen": 1, "kept": 1}, lambda saved, _: restored.update(counts=saved),
                        version=2, upgrade=lambda version, saved: {**saved, "kept": saved["seen"]}))
    parts.add(StatePart("task", lambda: {}, None))  # read by the resume checks, never restored
    state = TrainingState({"counts": {"seen": 5}, "task": {}}, 1, {}, {"counts": 1})
    parts.restore(state, context())
    assert restored == {"counts": {"seen": 5, "kept": 5}}

    parts.add(StatePart("best", lambda: 0.0, lambda saved, _: None))
    with pytest.raises(CheckpointError) as refused:
        parts.restore(state, context())
    assert str(refused.value) == (
        "checkpoint ckpt/step-3 holds no part 'best', and this trainer reads version 1 only; resume it with the "
        "trainer release that wrote it, or use another --checkpoint-dir or --resume none (the checkpoints are kept)")


def test_a_checkpoint_from_a_newer_trainer_is_refused_and_a_part_name_is_taken_once():
    parts = StateParts()
    parts.add(StatePart("counts", dict, lambda saved, _: None))
    with pytest.raises(CheckpointError, match="holds part 'counts' at version 2, and this trainer reads version 1"):
        parts.restore(TrainingState({"counts": {}}, 1, {}, {"counts": 2}), context())
    for taken in ("counts", "world_size"):
        with pytest.raises(ValueError, match=f"checkpoint part '{taken}' is taken"):
            parts.add(StatePart(taken, dict, None))
