"""What a checkpoint holds: one typed schema, captured and restored here as matching pairs.

Adding a piece of state is one edit in this file: a field of ``TrainingState``, its line in
``capture`` and its line in ``restore`` (and, if it is a live object, a field of ``Trainable``).
Everything is stored as plain types and tensors, so checkpoints load with ``weights_only=True``.

Format history (the manifest's "format"):
  2  the first release: the config's model and dataset names identify the run; "scaler", "scheduler"
  3  the task's identity and options; "grad_scaler"; no learning-rate "scheduler" (it is a function of
     samples seen) nor "best_accuracy" (the manifests' metrics serve --keep-best)
Older formats are migrated when read; a format this trainer does not know is refused, never skipped.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from typing import Any

import numpy as np
import torch
from torch import nn

import trainer
from trainer.position import TrainingPosition
from trainer.rng import RngState, restore_rng, seed_after_resize

FORMAT = 3
READABLE = (2, 3)


class SchemaError(Exception):
    """The state file lacks what its format promises (a damaged or foreign file)."""


@dataclass
class TaskRecord:
    """The task a checkpoint belongs to: its declared name, how --task named it, and its options."""

    name: str
    source: str
    options: dict[str, Any]


@dataclass
class Trainable:
    """The live objects a checkpoint captures and restores (model unwrapped from DDP or compile)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    grad_scaler: torch.amp.GradScaler
    position: TrainingPosition


@dataclass
class TrainingState:
    model: dict[str, Any]
    optimizer: dict[str, Any]
    grad_scaler: dict[str, Any]
    position: TrainingPosition
    task: TaskRecord
    config: dict[str, Any]  # the trainer's sections as Config.to_dict() writes them, less the task
    world_size: int
    rng: list[RngState]  # one per rank, in rank order (gathered by the checkpoint manager)
    versions: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        raw = {field.name: getattr(self, field.name) for field in fields(self)}
        raw["position"] = self.position.to_dict()
        raw["task"] = asdict(self.task)
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any], format_version: int) -> TrainingState:
        if format_version == 2:
            raw = _from_format_2(raw)
        missing = [field.name for field in fields(cls) if field.name not in raw]
        if missing:
            raise SchemaError(f"state.pt lacks {', '.join(missing)}")
        values = {field.name: raw[field.name] for field in fields(cls)}
        values["position"] = TrainingPosition.from_dict(raw["position"])
        values["task"] = TaskRecord(**raw["task"])
        return cls(**values)

    def manifest(self, metrics: dict[str, float] | None) -> dict[str, Any]:
        """What the manifest says of this state, readable without loading it."""
        described: dict[str, Any] = {"step": self.position.step, "epoch": self.position.epoch,
                                     "samples_in_epoch": self.position.samples_in_epoch,
                                     "world_size": self.world_size, "task": self.task.name}
        if metrics is not None:
            described["metrics"] = metrics
        return described


def capture(parts: Trainable, task: TaskRecord, config: dict[str, Any], world_size: int) -> TrainingState:
    """This rank's state; the checkpoint manager fills in ``rng`` (every rank's) and ``versions``."""
    return TrainingState(
        model=parts.model.state_dict(),
        optimizer=parts.optimizer.state_dict(),
        grad_scaler=parts.grad_scaler.state_dict(),
        position=TrainingPosition(**parts.position.to_dict()),
        task=task,
        config=config,
        world_size=world_size,
        rng=[],
        versions={},
    )


def restore(state: TrainingState, parts: Trainable, rank: int, world_size: int, seed: int) -> None:
    """Load the state into the live objects (the caller checked that it belongs to this run)."""
    parts.model.load_state_dict(state.model)
    parts.optimizer.load_state_dict(state.optimizer)
    parts.grad_scaler.load_state_dict(state.grad_scaler)
    for field in fields(TrainingPosition):
        setattr(parts.position, field.name, getattr(state.position, field.name))
    if state.world_size == world_size:
        restore_rng(state.rng[rank])
    else:
        seed_after_resize(seed, state.position.step, rank)


def library_versions() -> dict[str, str]:
    return dict(_library_versions())


@functools.cache  # the same for the process's life; reading package metadata took 0.7 ms a save
def _library_versions() -> dict[str, str]:
    # str(): torch.__version__ is a TorchVersion, a class weights_only loading refuses. torchvision's
    # version comes from its metadata: importing it costs seconds in processes that only save.
    return {
        "trainer": str(trainer.__version__),
        "torch": str(torch.__version__),
        "torchvision": metadata.version("torchvision"),
        "numpy": str(np.__version__),
        "python": platform.python_version(),
    }


# Format 2 kept the classification task's options in the trainer's sections.
_FORMAT_2_TASK_OPTIONS = {"data": ("dataset", "data_dir", "download", "data_cache_dir", "synthetic_shape",
                                   "synthetic_train_size", "synthetic_test_size", "synthetic_classes"),
                          "model": ("model",)}


def _from_format_2(raw: dict[str, Any]) -> dict[str, Any]:
    try:
        config = {section: dict(values) for section, values in raw["config"].items()}
        options = {name: config[section].pop(name) for section, names in _FORMAT_2_TASK_OPTIONS.items()
                   for name in names if name in config[section]}
        config["data"]["num_workers"] = str(config["data"].get("num_workers", 0))
        position = {key: value for key, value in raw["position"].items() if key != "best_accuracy"}
        return {**{key: value for key, value in raw.items() if key not in ("scaler", "scheduler")},
                "grad_scaler": raw["scaler"], "position": position, "config": config,
                "task": {"name": "classification", "source": "classification", "options": options}}
    except (KeyError, AttributeError, TypeError) as error:
        raise SchemaError(f"state.pt does not have format 2's layout ({type(error).__name__}: {error})") from None
