"""Membership changes inside one running torchrun job, under ddp, fsdp and hsdp: real elastic agents on loopback
(``--nnodes=1:2``, a c10d rendezvous, one agent = one node of one rank). A node is lost mid-epoch (its agent and
worker killed), the survivor goes on alone from the newest checkpoint; a node joins, and the job grows back. No
person, no relaunch, and the ledger task counts every sample of the epoch trained exactly once across the whole
history.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from devtools.elastic import ElasticJob
from devtools.processes import torchrun
from tests.integration.test_resize import LEDGER, assert_each_sample_trained_once, ledger

pytestmark = pytest.mark.slow

# The ledger task's epoch, long enough at one rank (about 40 steps after the loss) for a node to join mid-epoch
# (the join takes 10-15 s here); per rank.
SAMPLES, BATCH = 192, 4
PACED = [*[arg if arg != "tests.support.tasks:LedgerTask" else "tests.support.tasks:PacedLedgerTask"
           for arg in LEDGER if arg != "--sample-log"], "--train-size", str(SAMPLES), "--step-delay-s", "0.4",
         "--checkpoint-every", "2"]


def checkpoint_steps(run: Path) -> list[int]:
    folder = run / "checkpoints"
    return sorted(int(entry.name.split("-")[1]) for entry in folder.glob("step-*")) if folder.is_dir() else []


RESUMED = re.compile(r"\[rank 0/(\d+)\] INFO resumed from \S+step-(\d+): epoch")


def segments(logs: list[str]) -> list[tuple[int, int]]:
    """(world size, the step it resumed from) of each start of the workers after the first, in order: each
    resumes a newer checkpoint than the one before."""
    return sorted(((int(m.group(1)), int(m.group(2))) for text in logs for m in RESUMED.finditer(text)),
                  key=lambda segment: segment[1])


def step_sizes(first_world: int, resumes: list[tuple[int, int]]) -> list[int]:
    """The samples of each step the final checkpoint's history holds: each segment's steps until the next segment
    resumed (what it trained beyond that checkpoint was rolled back), the last one to the end of the epoch."""
    sizes: list[int] = []
    world = first_world
    for next_world, resumed_step in [*resumes, (0, None)]:
        while (resumed_step is None or len(sizes) < resumed_step) and sum(sizes) < SAMPLES:
            sizes.append(min(world * BATCH, SAMPLES - sum(sizes)))
        assert resumed_step is None or len(sizes) == resumed_step, (resumes, sizes)
        world = next_world
    return sizes


@pytest.mark.parametrize("sync", ["ddp", "fsdp", "hsdp"])
def test_a_node_lost_mid_epoch_and_one_added_later_the_job_goes_on_by_itself_training_every_sample_once(tmp_path,
                                                                                                       sync):
    run = tmp_path / "run"
    job = ElasticJob(tmp_path, [*PACED, "--sync", sync, "--output-dir", str(run)])
    first = job.start("first")  # serves the rendezvous: it must stay
    time.sleep(1)
    lost = job.start("lost")
    try:
        job.wait_for(lambda: any(step >= 4 for step in checkpoint_steps(run)), "two ranks to checkpoint step 4")
        lost.lose()
        job.wait_for(lambda: "[rank 0/1] INFO resumed from" in first.text(), "the survivor to resume alone")
        joined = job.start("joined")
        # Meanwhile, an unrelated job on the same checkpoint folder is still refused.
        other = torchrun([*PACED, "--sync", sync, "--output-dir", str(run)], nproc=1, timeout_s=120)
        held = re.search(r"is (in use by another job \(|kept by job )torchrun-elastic-test", other.stderr)
        assert other.returncode != 0 and held, other.stderr[-3000:]
        for agent in (first, joined):
            job.wait_for(lambda agent=agent: agent.process.poll() is not None, "the job to end", timeout_s=240)
            assert agent.process.returncode == 0, agent.text()[-3000:]
    finally:
        job.stop()
    logs = [agent.text() for agent in job.agents]
    resumes = segments(logs)
    assert [world for world, _ in resumes] == [1, 2], resumes  # shrunk to one rank, then grew back to two
    sizes = step_sizes(2, resumes)
    assert resumes[1][1] < len(sizes), "the job grew back before the end of the epoch"
    assert_each_sample_trained_once(ledger(run), sizes)
    # Every start of the workers was the same job: none refused by the lease, none took it over. The survivor,
    # stopped by its agent's signal for the join, kept the lease for the next attempt instead of releasing it.
    assert not any("in use by another job" in text or "took over the lease" in text for text in logs), logs
    alone = first.text().split("[rank 0/1] INFO resumed from", 1)[1]
    assert "keeping the lease of checkpoint folder" in alone and "(stopped by a signal)" in alone, alone[-3000:]
