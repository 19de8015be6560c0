"""Membership changes inside one running torchrun job, under ddp, fsdp and hsdp: real elastic agents on loopback
(``ddp-torchrun``, a c10d rendezvous, one agent = one node of one rank). Nodes are lost mid-epoch (two at once,
or one in the middle of a checkpoint save), the survivor goes on alone from the newest checkpoint; a node joins,
and the job grows back. No person, no relaunch, and the ledger task counts every sample of the epoch trained
exactly once across the whole history. Below the minimum size, the job ends in one line.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from devtools.elastic import FAST_RENDEZVOUS, ElasticJob
from devtools.processes import torchrun
from tests.integration.test_resize import LEDGER
from tests.support.checkpoint_reading import summary
from tests.support.ledger_checks import assert_each_sample_trained_once, ledger, segments, trained_straight_through

pytestmark = pytest.mark.slow

# The ledger task's epoch: 48 steps of 12 samples at every world size (--global-batch-size), about 40 of them
# after the loss, long enough for a node to join mid-epoch (the join takes 10-15 s here).
SAMPLES, GLOBAL_BATCH = 576, 12
ONE_EPOCH = [*LEDGER, "--train-size", str(SAMPLES), "--global-batch-size", str(GLOBAL_BATCH)]
PACED = [*[arg if arg != "tests.support.ledger:LedgerTask" else "tests.support.ledger:PacedLedgerTask"
           for arg in ONE_EPOCH if arg != "--sample-log"], "--step-delay-s", "0.4"]
STEP = re.compile(r"\Astep-(\d+)")


def checkpoint_folders(run: Path) -> dict[str, int]:
    """Every save folder (committed or not) and its step: ``step-N`` on a disk, ``step-N.<id>`` on fsspec."""
    folder = run / "checkpoints"
    found = {entry.name: STEP.match(entry.name) for entry in folder.iterdir()} if folder.is_dir() else {}
    return {name: int(match.group(1)) for name, match in found.items() if match}


@dataclass(frozen=True)
class Loss:
    """How the job loses nodes: how many at once, in the middle of a save or not, saves by steps or seconds."""

    nodes: int = 1
    during_save: bool = False
    timed_saves: bool = False


# One kind of loss per sync method: each run is a minute on two cores.
LOSSES = {"ddp": Loss(nodes=2), "fsdp": Loss(during_save=True), "hsdp": Loss(timed_saves=True)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """The ledger of the same epoch trained straight through at one rank, which every elastic history must end at."""
    return trained_straight_through(ONE_EPOCH, tmp_path_factory.mktemp("uninterrupted"))


@pytest.mark.parametrize("sync", ["ddp", "fsdp", "hsdp"])
def test_nodes_lost_mid_epoch_and_one_added_later_the_job_goes_on_by_itself_training_every_sample_once(
        tmp_path, sync, uninterrupted):
    loss, run = LOSSES[sync], tmp_path / "run"
    args = [*PACED, "--sync", sync, "--output-dir", str(run),
            *(["--checkpoint-every-s", "0.7"] if loss.timed_saves else ["--checkpoint-every", "2"])]
    slow: dict[str, str] = {}
    if loss.during_save:  # the lost node's own share of the second save takes 8 s: it is lost while writing it
        args += ["--checkpoint-dir", f"slowfile://{run}/checkpoints"]
        slow = {"SLOW_FILE": ".distcp", "SLOW_AFTER": "1", "SLOW_SAVE_S": "8", "SLOW_ONCE": str(tmp_path / "slow")}
    # Three nodes start in one round: its last call waits 5 s for the third (on two busy cores, an agent can take
    # seconds to start).
    rendezvous = FAST_RENDEZVOUS.replace("last_call_timeout=1", "last_call_timeout=5") if loss.nodes > 1 else \
        FAST_RENDEZVOUS
    module, env = "tests.workers.slow_storage" if loss.during_save else "trainer", {"SLOW_SAVE_S": "0"}
    job = ElasticJob(tmp_path, args, nnodes=f"1:{1 + loss.nodes}", rdzv_conf=rendezvous, module=module,
                     env={**env, "LOGLEVEL": "INFO"})
    first = job.start("first")  # serves the rendezvous: it must stay
    time.sleep(1)
    lost = [job.start(f"lost-{index}", slow) for index in range(loss.nodes)]
    interrupted: dict[str, int] = {}
    try:
        if loss.during_save:
            job.wait_for(lambda: "slow write started" in lost[0].text(), "the lost node to be writing its share")
            interrupted = {name: step for name, step in checkpoint_folders(run).items() if not committed(run, name)}
        else:
            job.wait_for(lambda: any(step >= 4 for step in checkpoint_folders(run).values()),
                         "the first ranks to checkpoint step 4")
        for agent in lost:  # at once: each kill is microseconds
            agent.lose()
        job.wait_for(lambda: "[rank 0/1] INFO resumed from" in first.text(), "the survivor to resume alone")
        joined = job.start("joined")
        # Meanwhile, an unrelated job on the same checkpoint folder is still refused.
        other = torchrun(args, nproc=1, timeout_s=120, module=module, env=env)
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
    sizes = [GLOBAL_BATCH] * (SAMPLES // GLOBAL_BATCH)  # the same steps at 3 (or 2), 1 and 2 ranks
    assert resumes[1][1] < len(sizes), "the job grew back before the end of the epoch"
    assert summary(run)["global_step"] == len(sizes), (summary(run), sizes)
    weights = ledger(run)
    assert_each_sample_trained_once(weights, sizes)
    assert torch.equal(weights, uninterrupted), "bitwise the model of the uninterrupted run at one rank"
    if loss.during_save:  # the save the lost node was writing never counted, and is gone
        assert len(interrupted) == 1 and resumes[0][1] < min(interrupted.values()), (interrupted, resumes)
        assert not interrupted.keys() & checkpoint_folders(run).keys(), "the unfinished save was removed"
    # Every start of the workers was the same job: none refused by the lease, none took it over. The survivor,
    # stopped by its agent's signal for the join, kept the lease for the next attempt instead of releasing it.
    assert not any("in use by another job" in text or "took over the lease" in text for text in logs), logs
    alone = first.text().split("[rank 0/1] INFO resumed from", 1)[1]
    assert "keeping the lease of checkpoint folder" in alone and "(stopped by a signal)" in alone, alone[-3000:]


def committed(run: Path, name: str) -> bool:
    return (run / "checkpoints" / name / "manifest.json").exists()  # the manifest, written last, commits a save


def test_below_the_minimum_size_the_job_waits_join_timeout_then_ends_in_one_line_naming_what_it_waited_for(
        tmp_path):
    job = ElasticJob(tmp_path, [], nnodes="2:3", rdzv_conf=f"{FAST_RENDEZVOUS},join_timeout=4",
                     module="tests.workers.allreduce_loop")
    first = job.start("first")
    lost = job.start("lost")
    try:
        job.wait_for(lambda: "all-reducing at world size 2" in first.text(), "the job to start at two nodes")
        lost.lose()
        job.wait_for(lambda: first.process.poll() is not None, "the survivor's agent to give up", timeout_s=90)
    finally:
        job.stop()
    text = first.text()
    assert first.process.returncode == 3, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last == (f"ddp-torchrun: error: the rendezvous of job 'elastic-test' at {job.endpoint} waited 4 s "
                    f"(join_timeout) for at least 2 node(s) (--nnodes=2:3), and fewer came; start more nodes, lower "
                    f"the minimum of --nnodes, or raise --rdzv-conf=join_timeout. The checkpoints are intact: a job "
                    f"started again with the same --rdzv-id resumes from the newest"), last
