"""The slow rank, named: every few steps the ranks compare their data-wait and forward times.

DDP's all-reduce hides a rank that computes slowly: every other rank waits for it in the backward pass, so all
steps take the same time and the step time names no one. Each rank's own parts of a step (trainer.step_timing:
data wait, and forward with loss) do differ. Every ``every`` optimizer steps all ranks all-gather their window's
parts over the control channel (gloo, CPU tensors; started asynchronously, read at the next step, like the stop
vote), and every rank judges the same numbers alike, so records are written at the same step everywhere.

A rank's part is slow in a window when it is at least ``ratio`` times the other ranks' median and the excess is
worth naming: at least MIN_EXCESS_S a step and MIN_SHARE of a step (so that near-zero data waits, 0.05 ms against
0.2 ms, are noise, not a finding). IN_A_ROW slow windows name the rank once (a warning on rank 0, a "slow_rank"
record); IN_A_ROW windows that are not slow say it recovered. A rank slow in both parts is named for each.

The verdict is per process: nothing is saved in checkpoints, and an elastic restart or resize starts afresh.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trainer.distributed import Runtime, gather_to_main
from trainer.step_timing import StepParts, StepTiming

__all__ = ["IN_A_ROW", "PARTS", "PartTimes", "RankComparison", "SlowRankEvent", "SlowRanks", "Verdicts"]

PARTS = ("data", "compute")
IN_A_ROW = 3  # windows: with --slow-rank-every 10, a rank slow from the start is named at step 31
# An excess worth a warning: it costs every rank that much of each step. Under half a millisecond is a timer's and
# a scheduler's noise, and under 5% of a step (in-memory data: 1.7 ms a step of 60 here) not worth chasing.
MIN_EXCESS_S = 0.0005
MIN_SHARE = 0.05  # of the median rank's step time
_WORDS = {"data": "waiting for its batches: loading, and the copy to the device",
          "compute": "its forward pass and loss"}


@dataclass(frozen=True)
class PartTimes:
    """One part of the step, compared across ranks over a window."""

    part: str  # "data" or "compute"
    seconds_per_step: tuple[float, ...]  # by rank
    others_s: tuple[float, ...]  # by rank: the other ranks' median, per step
    ratios: tuple[float, ...]  # by rank: its time over the other ranks' median
    slow: tuple[bool, ...]  # by rank: over the ratio and the floor in this window

    @property
    def slowest_rank(self) -> int:
        return max(range(len(self.ratios)), key=self.ratios.__getitem__)


@dataclass(frozen=True)
class RankComparison:
    """The latest comparison, as SlowRanks.latest holds it (for an exporter: per-rank gauges and the named)."""

    step: int  # the optimizer step its window ended at
    steps: int  # optimizer steps in the window
    step_s: float  # the median rank's wall time per step
    parts: tuple[PartTimes, ...]
    named: frozenset[tuple[int, str]]  # (rank, part) named slow and not recovered since


@dataclass(frozen=True)
class SlowRankEvent:
    """A rank named slow in a part (``slow``), or recovered; its figures over the last IN_A_ROW windows."""

    rank: int
    part: str
    slow: bool
    seconds_per_step: float
    others_s: float  # the other ranks' median, per step
    ratio: float
    steps: int
    step_s: float

    def record(self) -> dict[str, float]:
        """metrics.jsonl's "slow_rank" record (numbers only, as every record: the part is in the keys)."""
        return {"rank": self.rank, "slow": int(self.slow), f"{self.part}_ratio": round(self.ratio, 4),
                f"{self.part}_ms": round(self.seconds_per_step * 1e3, 3),
                f"others_{self.part}_ms": round(self.others_s * 1e3, 3), "steps": self.steps,
                "step_ms": round(self.step_s * 1e3, 3)}

    def describe(self, place: str) -> str:
        figures = (f"{_times(self.ratio)} the other ranks' median over the last {self.steps} steps "
                   f"({_ms(self.seconds_per_step)} a step against {_ms(self.others_s)})")
        if not self.slow:
            return f"rank {self.rank} ({place}) is no longer slow in {self.part}: {figures}"
        excess = self.seconds_per_step - self.others_s
        return (f"rank {self.rank} ({place}) is slow in {self.part} ({_WORDS[self.part]}): {figures}; it costs "
                f"every rank about {_ms(excess)} a step ({excess / max(self.step_s, 1e-9):.0%} of a step)")


def part_times(parts: Sequence[StepParts], part: str, ratio: float) -> PartTimes:
    """Each rank's ``part`` per step against the other ranks' median; which ranks are slow in it."""
    times = [getattr(rank, f"{part}_s") / max(rank.steps, 1) for rank in parts]
    floor = max(MIN_EXCESS_S, MIN_SHARE * median_step_s(parts))
    others = [statistics.median(times[:rank] + times[rank + 1:]) for rank in range(len(times))]
    ratios = [mine / max(theirs, 1e-9) for mine, theirs in zip(times, others, strict=True)]
    slow = [mine >= ratio * theirs and mine - theirs >= floor for mine, theirs in zip(times, others, strict=True)]
    return PartTimes(part, tuple(times), tuple(others), tuple(ratios), tuple(slow))


def median_step_s(parts: Sequence[StepParts]) -> float:
    """The median rank's wall time per step."""
    return statistics.median(rank.step_s / max(rank.steps, 1) for rank in parts)


def summed(windows: Sequence[Sequence[StepParts]]) -> list[StepParts]:
    """Several windows as one, rank by rank."""
    return [StepParts(sum(w[r].data_s for w in windows), sum(w[r].compute_s for w in windows),
                      sum(w[r].step_s for w in windows), sum(w[r].steps for w in windows))
            for r in range(len(windows[0]))]


class Verdicts:
    """Windows in, names out: the rule of the module's docstring, on numbers alone (no process group)."""

    def __init__(self, ratio: float, parts: tuple[str, ...] = PARTS) -> None:
        self.ratio = ratio
        self.parts = parts
        self.named: set[tuple[int, str]] = set()
        self._recent: deque[Sequence[StepParts]] = deque(maxlen=IN_A_ROW)
        self._slow_run: Counter[tuple[int, str]] = Counter()
        self._clear_run: Counter[tuple[int, str]] = Counter()

    def add(self, window: Sequence[StepParts], step: int) -> tuple[RankComparison, list[SlowRankEvent]]:
        self._recent.append(window)
        compared = tuple(part_times(window, part, self.ratio) for part in self.parts)
        events = []
        for times in compared:
            for rank, slow in enumerate(times.slow):
                key = (rank, times.part)
                self._slow_run[key] = self._slow_run[key] + 1 if slow else 0
                self._clear_run[key] = 0 if slow else self._clear_run[key] + 1
                if slow and key not in self.named and self._slow_run[key] >= IN_A_ROW:
                    self.named.add(key)
                elif not slow and key in self.named and self._clear_run[key] >= IN_A_ROW:
                    self.named.remove(key)
                else:
                    continue
                events.append(self._event(rank, times.part, slow))
        return RankComparison(step, window[0].steps, median_step_s(window), compared, frozenset(self.named)), events

    def _event(self, rank: int, part: str, slow: bool) -> SlowRankEvent:
        recent = summed(list(self._recent))
        times = part_times(recent, part, self.ratio)
        return SlowRankEvent(rank, part, slow, times.seconds_per_step[rank], times.others_s[rank], times.ratios[rank],
                             recent[rank].steps, median_step_s(recent))


class SlowRanks:
    """The comparison every ``every`` optimizer steps (0: off; off at world size 1, with no one to compare)."""

    def __init__(self, every: int, ratio: float, runtime: Runtime, model: nn.Module, forward_waits_for: str,
                 log: logging.Logger) -> None:
        """``forward_waits_for``: what makes each rank's forward wait for the others (--sync-bn, a sharded
        --sync), where it does: then only data is compared."""
        self.every = every
        self.control = runtime.control if every else None
        self.world_size = runtime.identity.world_size
        self.is_main = runtime.is_main
        self.log = log
        enabled = self.control is not None
        self.timing = StepTiming(model, runtime.device, enabled, time_compute=not forward_waits_for)
        self.verdicts = Verdicts(ratio, PARTS if not forward_waits_for else ("data",))
        self.latest: RankComparison | None = None  # the newest comparison: every rank has the same
        self._pending: tuple[dist.Work, list[torch.Tensor], torch.Tensor, int] | None = None
        self._places: list[tuple[str, int]] | None = None
        if enabled:
            identity = runtime.identity
            self._places = gather_to_main((identity.hostname, identity.local_rank), runtime)
            if forward_waits_for and self.is_main:
                log.info("slow ranks: comparing data waits only, not forward times: with %s each rank's forward "
                         "pass waits for the others", forward_waits_for)

    def after_step(self, step: int) -> list[dict[str, float]]:
        """Called on every rank after each optimizer step: the "slow_rank" records to write at this step (the
        same on every rank), logged on rank 0."""
        self.timing.step_done()
        if self.control is None:
            return []
        records = []
        if self._pending is not None:
            records = [event.record() for event in self._judge()]
        if step % self.every == 0:
            self._start(step)
        return records

    def _start(self, step: int) -> None:
        parts = self.timing.window()
        mine = torch.tensor([parts.data_s, parts.compute_s, parts.step_s, parts.steps], dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, mine, group=self.control, async_op=True)
        assert work is not None
        self._pending = (work, gathered, mine, step)

    def _judge(self) -> list[SlowRankEvent]:
        assert self._pending is not None
        work, gathered, _, step = self._pending
        self._pending = None
        work.wait()
        window = [StepParts(data_s, compute_s, step_s, int(steps))
                  for data_s, compute_s, step_s, steps in (row.tolist() for row in gathered)]
        self.latest, events = self.verdicts.add(window, step)
        if self.is_main and self._places is not None:
            for event in events:
                host, local_rank = self._places[event.rank]
                level = logging.WARNING if event.slow else logging.INFO
                self.log.log(level, "%s", event.describe(f"{host}, local rank {local_rank}"))
        return events

    def finish(self) -> None:
        """Where training ends, on every rank: the comparison still in flight is waited for (not judged)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def close(self) -> None:
        self.timing.close()


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:,.0f}x"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if abs(ms) >= 1 else f"{ms:.2f} ms"
