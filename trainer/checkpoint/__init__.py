"""Checkpoints: crash-consistent storage, full training state, resume."""

from trainer.checkpoint.manager import CheckpointManager, InvalidCheckpoint, LoadedCheckpoint, verify
from trainer.checkpoint.storage import CheckpointStorage, open_storage

__all__ = ["CheckpointManager", "CheckpointStorage", "InvalidCheckpoint", "LoadedCheckpoint", "open_storage",
           "verify"]
