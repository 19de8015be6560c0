"""--metrics-port on a real 2-rank torchrun run, scraped while it trains: the run stops at a gate in its fifth step
(tests/support/tasks.py, GatedTask), after its first epoch's evaluation and checkpoints, and the test reads the
node's endpoint (local rank 0's, with rank 1's series) and rank 1's own until the values are there, as Prometheus
would, then lets the run finish."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.processes import REPO_ROOT, clean_env, kill_session
from tests.support.prometheus_scrape import Scrape, consecutive_free_ports, scrape

pytestmark = pytest.mark.slow

# 64 samples, 2 ranks x 8: 4 steps an epoch. The gate holds rank 0 in the ninth loss call, step 5's (after the
# first-batch checks', steps 1-4' and the evaluation's), and rank 1 in that step's gradient all-reduce.
ARGS = ["--task", "tests.support.tasks:GatedTask", "--batch-size", "8", "--epochs", "2", "--log-every", "1",
        "--checkpoint-every", "2", "--slow-rank-every", "2", "--progress", "off", "--no-tensorboard",
        "--num-workers", "0", "--gate-at", "9", "--metrics-host", "127.0.0.1"]
JOB = "prometheus-test"


def complete(node: Scrape) -> bool:
    """Both ranks past step 4: the epoch's evaluation, checkpoint 4 committed, the slow-rank comparison made."""
    return all((node.value("ddp_step", job_id=JOB, rank=str(rank)) or 0) >= 4
               and node.value("ddp_eval_loss", job_id=JOB, rank=str(rank)) is not None
               and (node.value("ddp_checkpoint_committed_step", job_id=JOB, rank=str(rank)) or 0) >= 4
               and node.value("ddp_step_part_seconds", job_id=JOB, rank=str(rank), part="data") is not None
               for rank in (0, 1))


def shown(node: Scrape | str) -> str:
    if isinstance(node, str):
        return node
    return ", ".join(f"{name}{dict(labels)} {value:g}" for (name, labels), value in sorted(node.values.items())
                     if name in ("ddp_step", "ddp_eval_loss", "ddp_checkpoint_committed_step", "ddp_step_part_seconds"))


def scraped_until_complete(url: str, process: subprocess.Popen[str], deadline_s: float = 120) -> Scrape:
    deadline = time.monotonic() + deadline_s
    while True:
        assert process.poll() is None, f"the run exited with {process.returncode} before it was scraped"
        try:
            node: Scrape | str = scrape(url, openmetrics=True)
        except OSError as error:  # not listening yet: the ranks are still starting
            node = str(error)
        if isinstance(node, Scrape) and complete(node):
            return node
        assert time.monotonic() < deadline, f"the node's endpoint never showed both ranks at the gate: {shown(node)}"
        time.sleep(0.1)


def test_a_two_rank_run_is_scraped_while_it_trains_and_once_it_resumes(tmp_path: Path):
    port, gate = consecutive_free_ports(2), tmp_path / "gate"
    gate.mkdir()
    started = time.time()
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainer", *ARGS,
         "--gate", str(gate), "--metrics-port", str(port), "--output-dir", str(tmp_path / "run"), "--job-id", JOB],
        env=clean_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        node = scraped_until_complete(f"http://127.0.0.1:{port}/metrics", process)
        classic = scrape(f"http://127.0.0.1:{port}/metrics")  # the classic text format says the same
        own = scrape(f"http://127.0.0.1:{port + 1}/metrics", openmetrics=True)
        (gate / "go").touch()
        _, stderr = process.communicate(timeout=240)
    finally:
        kill_session(process)
    assert process.returncode == 0, stderr[-3000:]
    now = time.time()

    assert node.ranks("ddp_step") == {"0", "1"} and own.ranks("ddp_step") == {"1"}
    assert classic.ranks("ddp_step") == {"0", "1"}
    assert node.value("ddp_local_rank_up", job_id=JOB, local_rank="1") == 1
    for rank in ("0", "1"):
        def of(name: str, rank: str = rank, **labels: str) -> float:
            found = node.value(name, job_id=JOB, rank=rank, **labels)
            assert found is not None, (name, rank, labels)
            return found

        assert of("ddp_world_size") == 2 and of("ddp_restarts") == 0
        assert of("ddp_samples_per_second") > 0 and 0 < of("ddp_step_seconds") < 60
        assert math.isfinite(of("ddp_train_loss")) and of("ddp_train_loss") > 0
        assert started <= of("ddp_last_step_timestamp_seconds") <= now
        assert started <= of("ddp_checkpoint_committed_timestamp_seconds") <= now
        assert of("ddp_checkpoint_save_seconds_count") >= 2  # steps 2 and 4, each waited for by every rank
        assert of("ddp_step_part_seconds", part="data") >= 0 and of("ddp_slow_rank_ratio", part="data") > 0
        assert of("ddp_slow_rank", part="data") in (0, 1)
    # Rank 0's are the records metrics.jsonl has at the step it stopped at.
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = node.value("ddp_step", job_id=JOB, rank="0")
    (train,) = [record for record in records if record["kind"] == "train" and record["step"] == step]
    tested = [record for record in records if record["kind"] == "test" and record["step"] <= step][-1]
    assert node.value("ddp_train_loss", job_id=JOB, rank="0") == train["loss"]
    assert node.value("ddp_samples_per_second", job_id=JOB, rank="0") == train["samples_per_s"]
    assert node.value("ddp_eval_loss", job_id=JOB, rank="0") == tested["loss"]
    assert node.value("ddp_checkpoint_write_seconds_count", job_id=JOB, rank="0") >= 2
    assert node.value("ddp_checkpoint_write_seconds_count", job_id=JOB, rank="1") is None  # rank 0 writes

    # Resumed for a third epoch (one process), held at its first loss call, before any new step: where training
    # stands is the checkpoint's, and so is the commit time, its manifest's, not 0 or the resume's.
    port, gate = consecutive_free_ports(1), tmp_path / "gate-resumed"
    gate.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer", *ARGS[:ARGS.index("--gate-at")], "--gate-at", "1", "--epochs", "3",
         "--gate", str(gate), "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
         "--output-dir", str(tmp_path / "run"), "--job-id", JOB],
        env=clean_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (gate / "reached").exists():
            assert process.poll() is None and time.monotonic() < deadline, "the resumed run never reached its gate"
            time.sleep(0.1)
        resumed = scrape(f"http://127.0.0.1:{port}/metrics")
        # Read before the run goes on: its new checkpoints prune this one.
        manifest = json.loads((tmp_path / "run" / "checkpoints" / "step-00000008" / "manifest.json").read_text())
        (gate / "go").touch()
        _, stderr = process.communicate(timeout=240)
    finally:
        kill_session(process)
    assert process.returncode == 0, stderr[-3000:]
    assert resumed.value("ddp_step", job_id=JOB, rank="0") == 8 and resumed.value("ddp_epoch", job_id=JOB,
                                                                                   rank="0") == 2
    assert resumed.value("ddp_samples_seen", job_id=JOB, rank="0") == 128
    assert resumed.value("ddp_checkpoint_committed_step", job_id=JOB, rank="0") == 8
    assert resumed.value("ddp_checkpoint_committed_timestamp_seconds", job_id=JOB,
                         rank="0") == manifest["created_unix"]
