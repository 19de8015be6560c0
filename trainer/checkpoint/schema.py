"""What a checkpoint file holds: the named parts (trainer.checkpoint.parts) and a header, and the formats.

The parts are given by the components that own them; this module knows only the container, the parts every
checkpoint must have to be described (its position and task), and the history of the file's format.
Everything is stored as plain types and tensors, so checkpoints load with ``weights_only=True``.

Format history (the manifest's "format"; each part's layout has its own version, "part_versions"):
  2  the first release: the config's model and dataset names identify the run; "scaler", "scheduler"
  3  the task's identity and options; "grad_scaler"; no learning-rate "scheduler" (it is a function of
     samples seen) nor "best_accuracy" (the manifests' metrics serve --keep-best). Since the named parts,
     "part_versions" too (absent: every part at version 1)
  4  format 3 with sharded tensors (--sync fsdp/hsdp): markers in the parts, each rank's rows in its own
     ``shards-RRRRR.pt``, and a "shards" entry saying which file holds which rows (trainer.checkpoint.shards).
     Unsharded checkpoints are still written in format 3. Read, no longer written
  5  format 3 with its tensors in torch.distributed.checkpoint's files (--sync fsdp/hsdp): every tensor of the
     replicated parts replaced by a marker naming its DCP key, the files DCP's own (``__R_0.distcp``,
     ``.metadata``) and ``items.json`` (every item's CRC-32) beside them (trainer.checkpoint.dcp_writer); the
     optimizer part keyed by parameter name (its version 2)
Older formats are migrated when read; a format this trainer does not know is refused, never skipped.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import numpy as np
import torch

import trainer
from trainer.position import TrainingPosition

FORMAT = 3
SHARDED_FORMAT = 4  # read, no longer written
DCP_FORMAT = 5
READABLE = (2, 3, 4, 5)


# What the manifest and the resume checks read before any part is restored.
REQUIRED_PARTS = ("position", "task")


class SchemaError(Exception):
    """The state file lacks what its format promises (a damaged or foreign file)."""


@dataclass
class TaskRecord:
    """The task a checkpoint belongs to: its declared name, how --task named it, and its options."""

    name: str
    source: str
    options: dict[str, Any]


# The checkpoint's own entries beside the parts (trainer.checkpoint.parts), written by the checkpoint manager.
HEADER = ("world_size", "versions", "part_versions")
# Format 4's one entry more: which rows of which sharded tensor each shard file holds.
SHARDED_HEADER = ("shards",)


@dataclass
class TrainingState:
    """A checkpoint's content: every part's value by name, and the header."""

    parts: dict[str, Any]
    world_size: int
    versions: dict[str, str]  # of the libraries that wrote it
    part_versions: dict[str, int]  # of each part's layout (format 3 wrote none: every part it holds is version 1)
    # Parts captured on every rank, which the checkpoint manager gathers into a list in rank order (not saved).
    per_rank: tuple[str, ...] = ()
    # Format 4: which rows of which sharded tensor each shard file holds (trainer.checkpoint.shards).
    shards: dict[str, Any] | None = None

    def part_version(self, name: str) -> int:
        """The version of a part as saved; 0 when the checkpoint lacks it."""
        if name not in self.parts:
            return 0
        return int(self.part_versions.get(name, 1))

    # Typed views of the parts that the checkpoint manager, the resume checks and tools read.
    @property
    def position(self) -> TrainingPosition:
        return TrainingPosition.from_dict(self.parts["position"])

    @property
    def task(self) -> TaskRecord:
        return TaskRecord(**self.parts["task"])

    @property
    def config(self) -> dict[str, Any]:
        return self.parts["config"]

    @property
    def model(self) -> dict[str, Any]:
        return self.parts["model"]

    def to_dict(self) -> dict[str, Any]:
        raw = {**self.parts, "world_size": self.world_size, "versions": self.versions,
               "part_versions": self.part_versions}
        if self.shards is not None:
            raw["shards"] = self.shards
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any], format_version: int) -> TrainingState:
        if format_version == 2:
            raw = _from_format_2(raw)
        missing = [name for name in (*REQUIRED_PARTS, "world_size") if name not in raw]
        if missing:
            raise SchemaError(f"state.pt lacks {', '.join(missing)}")
        try:
            parts = {name: value for name, value in raw.items() if name not in (*HEADER, *SHARDED_HEADER)}
            TrainingPosition.from_dict(parts["position"])
            TaskRecord(**parts["task"])
            shards = raw.get("shards")
            if (format_version == SHARDED_FORMAT) != isinstance(shards, dict):
                raise SchemaError(f"state.pt {'lacks' if shards is None else 'has'} the shard layout of format 4")
            return cls(parts, int(raw["world_size"]), dict(raw.get("versions", {})),
                       {str(name): int(version) for name, version in raw.get("part_versions", {}).items()},
                       shards=shards)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise SchemaError(f"state.pt does not have the layout of format {format_version} "
                              f"({type(error).__name__}: {error})") from None

    def manifest(self, metrics: dict[str, float] | None) -> dict[str, Any]:
        """What the manifest says of this state, readable without loading it."""
        position = self.position
        described: dict[str, Any] = {"step": position.step, "epoch": position.epoch,
                                     "samples_in_epoch": position.samples_in_epoch,
                                     "world_size": self.world_size, "task": self.task.name}
        if metrics is not None:
            described["metrics"] = metrics
        return described


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
