"""Phases of a bare training loop, measured on two ranks: what a plan is, and what its records say.

bench/workers/phases.py runs the plan under torchrun; each figure builds a Plan, calls measure(), and
reads the PhaseTimes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness.launch import run, torchrun_command
from bench.harness.measure import median
from trainer.gradsync import SYNC_METHODS

BARE_METHODS = ("none", "bare-ddp")  # no communication; torch's DDP built here with the phase's options


@dataclass(frozen=True)
class Phase:
    name: str
    ranks: int = 2  # 1: rank 0 trains alone while rank 1 waits
    method: str = "bare-ddp"  # one of BARE_METHODS or a trainer.gradsync method (ddp, allreduce, reduce-broadcast)
    bucket_mb: float = 25.0  # torch's default
    grad_as_bucket_view: bool = False  # torch's default
    hook: str = ""  # "bf16": torch's bf16_compress_hook (gradients travel as bfloat16)
    accum: int = 1  # micro-batches per optimizer step; DDP syncs only the last (no_sync on the others)
    pin: bool = False  # every thread of rank r pinned to core r for the phase
    sync_bn: bool = False  # the trainer's SyncBatchNorm conversion
    stop_check: bool = False  # after every optimizer step, the trainer's stop vote (trainer.distributed.StopVote)
    batch_size: int = 0  # samples per rank and micro-batch; 0: the plan's

    def __post_init__(self) -> None:
        if self.method not in BARE_METHODS and self.method not in SYNC_METHODS:
            raise ValueError(f"phase {self.name}: unknown method {self.method!r}")
        if self.ranks not in (1, 2):
            raise ValueError(f"phase {self.name}: ranks must be 1 or 2, got {self.ranks}")


@dataclass(frozen=True)
class Plan:
    phases: list[Phase]
    rounds: int
    steps: int  # timed optimizer steps per phase and round
    warmup_steps: int = 1  # untimed steps before them: the phase's model was cold
    batch_size: int = 128

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        raw = json.loads(text)
        return cls([Phase(**phase) for phase in raw.pop("phases")], **raw)



class PhaseTimes:
    """The records of one bench.workers.phases launch, per phase and round."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def _of(self, phase: str, round_index: int) -> list[dict[str, Any]]:
        found = [r for r in self.records if r["phase"] == phase and r["round"] == round_index]
        if not found:
            raise KeyError(f"no records of phase {phase!r} in round {round_index}")
        return found

    @property
    def rounds(self) -> int:
        return 1 + max(r["round"] for r in self.records)

    def throughput(self, phase: str) -> list[float]:
        """Samples per second of all ranks together, one value per round."""
        return [sum(r["samples"] / r["wall_s"] for r in self._of(phase, i)) for i in range(self.rounds)]

    def cpu_per_sample(self, phase: str) -> list[float]:
        """CPU seconds (all threads) per sample, mean of the ranks, one value per round: the work done, however
        long the process waited for a core or for the other rank."""
        values = []
        for i in range(self.rounds):
            records = self._of(phase, i)
            values.append(sum(r["process_cpu_s"] / r["samples"] for r in records) / len(records))
        return values

    def step_time(self, phase: str) -> list[float]:
        """Seconds per optimizer step of the slowest rank, one value per round."""
        return [max(r["wall_s"] / r["steps"] for r in self._of(phase, i)) for i in range(self.rounds)]

    def parts(self, phase: str) -> dict[str, float]:
        """Median seconds per step in forward, backward, sync and optimizer, and gloo's CPU time per step."""
        per_round = []
        for i in range(self.rounds):
            mine = [r for r in self._of(phase, i) if r["rank"] == 0]
            steps = mine[0]["steps"]
            forward, backward, sync, optimizer = (value / steps for value in mine[0]["parts_s"])
            other_threads = (mine[0]["process_cpu_s"] - mine[0]["thread_cpu_s"]) / steps
            main_thread = mine[0]["thread_cpu_s"] / steps
            wall = mine[0]["wall_s"] / steps
            runqueue = mine[0]["runqueue_s"] / steps
            per_round.append({"forward": forward, "backward": backward, "sync": sync, "optimizer": optimizer,
                              "wall": wall, "main_thread_cpu": main_thread, "other_threads_cpu": other_threads,
                              "waiting_for_core": runqueue,
                              "blocked": max(wall - main_thread - runqueue, 0.0)})
        return {key: median([values[key] for values in per_round]) for key in per_round[0]}


    def describe(self, phase: str) -> str:
        """Rank 0's step, split by the scheduler: running, waiting for a core, blocked on the other rank."""
        parts = self.parts(phase)
        gloo = parts["other_threads_cpu"] * 1e3
        return (f"step {parts['wall'] * 1e3:.0f} ms = running {parts['main_thread_cpu'] * 1e3:.0f} + waiting for "
                f"a core {parts['waiting_for_core'] * 1e3:.0f} + blocked {parts['blocked'] * 1e3:.0f} ms"
                + (f" (gloo's threads: {gloo:.1f} ms CPU)" if gloo >= 0.5 else ""))


def measure(plan: Plan, work_dir: Path, timeout_s: float) -> PhaseTimes:
    """Run the plan on two ranks under torchrun and return what they recorded."""
    work_dir.mkdir(parents=True, exist_ok=True)
    plan_path, out_path = work_dir / "plan.json", work_dir / "phases.json"
    plan_path.write_text(plan.to_json())
    run(torchrun_command(2, "bench.workers.phases", [str(plan_path), str(out_path)]), timeout_s)
    return PhaseTimes(json.loads(out_path.read_text()))
