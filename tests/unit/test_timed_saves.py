"""--checkpoint-every-s: every rank saves at the same step, however their clocks differ (two real processes, one
whose clock never moves), one step after the interval passed on some rank, and the vote in flight at a save does
not save again at the next step."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from devtools.processes import free_port
from tests.support.spawned import SPAWN, spawned
from trainer.timed_saves import TimedSaves

pytestmark = pytest.mark.timeout(90)
STEPS = 13


def saves_at(every_s: float, clock_of_step: list[float], runtime: object) -> list[int]:
    """The steps at which a loop of STEPS steps saves, ``clock_of_step[step]`` being this rank's clock."""
    now = [clock_of_step[0]]
    timed = TimedSaves(every_s, runtime, clock=lambda: now[0])  # type: ignore[arg-type]
    saved = []
    for step in range(1, STEPS):
        now[0] = clock_of_step[step]
        if timed.due():
            saved.append(step)
            timed.saved()
    timed.settle()
    return saved


def _rank(rank: int, port: int, results: mp.Queue[tuple[int, list[int]]]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    clock = [float(step) for step in range(STEPS)] if rank == 1 else [0.0] * STEPS  # rank 0's never moves
    results.put((rank, saves_at(3.0, clock, SimpleNamespace(control=dist.group.WORLD))))
    dist.destroy_process_group()


def test_every_rank_saves_at_the_same_steps_one_step_after_the_interval_passed_on_some_rank():
    results, port = SPAWN.Queue(), free_port()
    with spawned(_rank, [(rank, port, results) for rank in (0, 1)]):
        saved = dict(results.get(timeout=60) for _ in range(2))
    # Rank 1's clock passes 3 s at step 3 (voted then, agreed at step 4); the save at 4 starts the interval again
    # (3 s later, at step 7: saved at 8), and the vote cast at step 4, before that save, is not a save at 5.
    assert saved == {0: [4, 8, 12], 1: [4, 8, 12]}, saved


def test_one_process_saves_at_the_step_the_interval_passed_and_off_means_no_vote():
    alone = SimpleNamespace(control=None)
    assert saves_at(3.0, [float(step) for step in range(STEPS)], alone) == [3, 6, 9, 12]
    assert saves_at(1.0, [float(step) for step in range(STEPS)], alone) == list(range(1, STEPS))
    assert saves_at(0.0, [float(step) for step in range(STEPS)], alone) == []
    assert TimedSaves(0.0, alone).vote is None  # type: ignore[arg-type]
