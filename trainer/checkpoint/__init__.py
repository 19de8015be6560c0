"""Checkpoints: the training state as named parts, crash-consistent storage, the folder's lease, resume."""

from trainer.checkpoint.manager import CheckpointManager, Committed, Monitor
from trainer.checkpoint.parts import PartKind, RestoreContext, StatePart, StateParts, add_run_parts
from trainer.checkpoint.reading import InvalidCheckpoint
from trainer.checkpoint.schema import FORMAT, TaskRecord, TrainingState
from trainer.checkpoint.storage import CheckpointStorage, open_storage
from trainer.checkpoint.verification import LoadedCheckpoint, verify
from trainer.position import TrainingPosition

__all__ = ["FORMAT", "CheckpointManager", "CheckpointStorage", "Committed", "InvalidCheckpoint", "LoadedCheckpoint",
           "Monitor", "PartKind", "RestoreContext", "StatePart", "StateParts", "TaskRecord", "TrainingPosition",
           "TrainingState", "add_run_parts", "open_storage", "verify"]
