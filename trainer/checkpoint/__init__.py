"""Checkpoints: crash-consistent storage, one typed schema of the training state, resume."""

from trainer.checkpoint.manager import CheckpointManager, InvalidCheckpoint, LoadedCheckpoint, Monitor, verify
from trainer.checkpoint.schema import FORMAT, TaskRecord, Trainable, TrainingState, capture, restore
from trainer.checkpoint.storage import CheckpointStorage, open_storage
from trainer.position import TrainingPosition

__all__ = ["FORMAT", "CheckpointManager", "CheckpointStorage", "InvalidCheckpoint", "LoadedCheckpoint", "Monitor",
           "TaskRecord", "Trainable", "TrainingPosition", "TrainingState", "capture", "open_storage", "restore",
           "verify"]
