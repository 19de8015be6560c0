"""Chaos: a 2-rank job killed again and again at random moments, relaunched each time with the same command until
it finishes, ends with the very weights of a run that was never interrupted.

The faults: SIGKILL of torchrun's whole process group (a node lost), SIGKILL of one rank (torchrun then stops the
other), SIGTERM of the group (a preemption: a checkpoint at the next step, exit 143). The moments are drawn from
a seeded generator: the seed is printed, and CHAOS_SEED=N reproduces a failure. Two jobs: DDP, and FSDP with
AdamW, BatchNorm and --async-checkpoint (every save's copies race the next steps). --job-id names the job, so
that a relaunch after a SIGKILL (its lease not released) is the same job taking over its own folder."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from devtools.processes import REPO_ROOT, clean_env, torchrun_command
from tests.support.checkpoint_reading import assert_same_tensors, newest_checkpoint

# 2 ranks x batch 6 over 240 samples: 20 steps an epoch, 2 epochs; a checkpoint every 3 steps.
ARGS = ["--dataset", "synthetic", "--synthetic-train-size", "240", "--synthetic-test-size", "24", "--batch-size",
        "6", "--epochs", "2", "--seed", "3", "--checkpoint-every", "3", "--keep-last", "3", "--progress", "off",
        "--no-tensorboard", "--log-every", "5", "--job-id", "chaos", "--grace-period-s", "20"]
JOBS = {"ddp": ["--sync", "ddp"],
        "fsdp-adamw-async": ["--sync", "fsdp", "--optimizer", "adamw", "--async-checkpoint"]}
FAULTS = ("kill the group", "kill one rank", "terminate the group")
MAX_FAULTS = 5
RUN_TIMEOUT_S = 300


def launch(output: Path, flags: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(torchrun_command(2, "trainer", [*ARGS, *flags, "--output-dir", str(output)]),
                            env=clean_env(), cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def ranks_of(process: subprocess.Popen[str]) -> list[int]:
    """torchrun's worker processes (its children)."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    return [int(pid) for pid in children.read_text().split()] if children.exists() else []


def inflict(fault: str, process: subprocess.Popen[str], chooser: random.Random) -> None:
    if fault == "kill one rank" and (ranks := ranks_of(process)):
        os.kill(chooser.choice(ranks), signal.SIGKILL)
    elif fault == "terminate the group":
        os.killpg(process.pid, signal.SIGTERM)
    else:
        os.killpg(process.pid, signal.SIGKILL)


def finish(process: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        raise AssertionError(f"a run did not end within {RUN_TIMEOUT_S} s: {stderr[-3000:]}") from None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # an orphaned rank must not outlive its attempt
    return process.returncode, stderr


@pytest.mark.parametrize("job", list(JOBS))
def test_a_job_killed_at_random_moments_and_relaunched_ends_bitwise_like_an_uninterrupted_one(job, tmp_path):
    seed = int(os.environ.get("CHAOS_SEED", random.SystemRandom().randrange(1_000_000)))
    print(f"chaos seed {seed} (rerun with CHAOS_SEED={seed})")
    chooser = random.Random(seed)
    flags = JOBS[job]
    straight = tmp_path / "uninterrupted"
    started = time.monotonic()
    code, stderr = finish(launch(straight, flags))
    assert code == 0, f"seed {seed}: {stderr[-3000:]}"
    run_s = time.monotonic() - started

    output, history = tmp_path / "chaos", []
    for attempt in range(MAX_FAULTS + 1):  # the last attempt runs undisturbed
        process = launch(output, flags)
        what = "undisturbed"
        if attempt < MAX_FAULTS:
            moment, fault = chooser.uniform(0.3, run_s), chooser.choice(FAULTS)
            try:
                process.wait(timeout=moment)
                what = f"ended before {fault} at {moment:.1f}s"
            except subprocess.TimeoutExpired:
                inflict(fault, process, chooser)
                what = f"{fault} at {moment:.1f}s"
        code, stderr = finish(process)
        history.append(f"{what}: exit {code}")
        if code == 0:
            assert "error:" not in stderr, f"seed {seed}, {history}: {stderr[-3000:]}"
            break
    else:
        raise AssertionError(f"seed {seed}: the job never finished: {history}; last: {stderr[-3000:]}")
    print(f"seed {seed}: {'; '.join(history)}")
    _, _, chaotic = newest_checkpoint(output / "checkpoints")
    _, _, reference = newest_checkpoint(straight / "checkpoints")
    assert chaotic["position"] == reference["position"], f"seed {seed}, {history}"
    for part in ("model", "optimizer"):
        assert_same_tensors(chaotic[part], reference[part], f"seed {seed}, {history}: {part}")
