"""Where training stands: the numbers that a resume needs to continue at the very next batch."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TrainingPosition:
    epoch: int = 0  # the epoch in progress (0-based); equals --epochs when training is complete
    step: int = 0  # optimizer steps taken in total
    samples_in_epoch: int = 0  # samples of this epoch's global order consumed by all ranks together
    samples_seen: int = 0  # samples consumed by all ranks since the start of training

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainingPosition:
        return cls(**{key: values[key] for key in cls.__dataclass_fields__})
