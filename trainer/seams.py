"""The registries of the seams the config names, declared apart from their entries.

The config validates --sync and --optimizer against these; the modules that implement them (which use the
config's types) fill them when imported, and a registry imports its home the first time its names are read.
So the config depends on names, never on the implementations: no import cycle.
"""

from __future__ import annotations

from typing import Any

from trainer.registry import Registry

__all__ = ["OPTIMIZERS", "SYNC_METHODS", "TRACKERS"]

SYNC_METHODS: Registry[Any] = Registry("gradient synchronisation method", "--sync",
                                       home=("trainer.gradsync", "trainer.sharding"))
OPTIMIZERS: Registry[Any] = Registry("optimizer", "--optimizer", home="trainer.optimizers")
# Each tracker's module imports its library only when a run starts it: the names are there without the extras.
TRACKERS: Registry[Any] = Registry("experiment tracker", "--tracker",
                                   home=("trainer.trackers.mlflow", "trainer.trackers.wandb"))
