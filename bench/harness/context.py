"""What every figure is given: the mode (full or --quick) and a scratch folder for its runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Context:
    quick: bool  # CI's smoke mode: every code path, tiny sizes, numbers not representative
    work_dir: Path  # scratch space for trainer outputs; removed after the run

    def pick(self, full: T, quick: T) -> T:
        return quick if self.quick else full

    def scratch(self, name: str) -> Path:
        path = self.work_dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path
