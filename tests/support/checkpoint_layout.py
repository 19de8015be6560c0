"""The checkpoint's saved layout, described without values, and the golden copy the tests keep of it.

Run ``python -m tests.support.checkpoint_layout`` to record the current layout, once the layout test has
agreed that each change comes with a version bump and an upgrade."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.build import state_parts
from trainer.checkpoint import FORMAT, StateParts, TaskRecord, TrainingPosition, add_run_parts
from trainer.checkpoint.schema import HEADER
from trainer.config import TrackingConfig
from trainer.rng import seed_everything
from trainer.tracking import Tracking

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint-layout.json"


def trainer_parts() -> StateParts:
    """The parts a run registers (build, loop, tracking), of a small model after an AdamW step."""
    seed_everything(0)  # no cached Gaussian in Python's or NumPy's generator: their state's layout is the same
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    parts = state_parts(model, optimizer, torch.amp.GradScaler("cpu", enabled=False))
    add_run_parts(parts, TrainingPosition(), TaskRecord("layout", "tests", {}), {})
    parts.add(Tracking(TrackingConfig(), Path("."), enabled=False, log=logging.getLogger("layout")).state_part())
    return parts


def describe_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value):
            return {key: describe_value(item) for key, item in sorted(value.items())}
        return {"<keys>": describe_value(next(iter(value.values()))) if value else None}
    if isinstance(value, list | tuple):
        return [describe_value(item) for item in value]
    return type(value).__name__


def describe(parts: StateParts) -> dict[str, Any]:
    captured = parts.capture(world_size=1).parts
    return {
        "format": FORMAT,
        "header": list(HEADER),
        "parts": {part.name: {"version": part.version, "kind": part.kind.value,
                              "layout": type(captured[part.name]).__name__ if part.opaque
                              else describe_value(captured[part.name])}
                  for part in parts},
    }


def recorded() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(describe(trainer_parts()), indent=1) + "\n")
    print(f"recorded {GOLDEN}")
