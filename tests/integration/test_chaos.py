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


def launch(output: Path, flags: list[str], log: Path) -> subprocess.Popen[str]:
    """torchrun of the job, its log in a file (a pipe would stay open as long as any rank it left behind)."""
    with log.open("w") as stderr:
        return subprocess.Popen(torchrun_command(2, "trainer", [*ARGS, *flags, "--output-dir", str(output)]),
                                env=clean_env(), cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                                start_new_session=True)


def descendants(pid: int) -> list[int]:
    """A process's children, theirs, and so on (torchrun starts its workers in sessions of their own: killing
    torchrun's process group leaves them running, which a lost node would not)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in map(int, (task / "children").read_text().split()):
                found += [child, *descendants(child)]
    return found


def kill_everything(process: subprocess.Popen[str]) -> None:
    for pid in [process.pid, *descendants(process.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def inflict(fault: str, process: subprocess.Popen[str], chooser: random.Random) -> None:
    ranks = descendants(process.pid)
    if fault == "kill one rank" and ranks:
        os.kill(chooser.choice(ranks), signal.SIGKILL)
    elif fault == "terminate the group":  # what a launcher's stop sends (torchrun passes it to the ranks)
        os.killpg(process.pid, signal.SIGTERM)
    else:  # the node is gone: torchrun and every rank at once
        kill_everything(process)


def finish(process: subprocess.Popen[str], log: Path) -> tuple[int, str]:
    """The attempt's exit code and log, once torchrun has ended; a rank it left behind is killed (it must not
    outlive its attempt)."""
    ranks = descendants(process.pid)
    try:
        process.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_everything(process)
        raise AssertionError(f"a run did not end within {RUN_TIMEOUT_S} s: {log.read_text()[-3000:]}") from None
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return process.returncode, log.read_text()


@pytest.mark.parametrize("job", list(JOBS))
def test_a_job_killed_at_random_moments_and_relaunched_ends_bitwise_like_an_uninterrupted_one(job, tmp_path):
    seed = int(os.environ.get("CHAOS_SEED", random.SystemRandom().randrange(1_000_000)))
    print(f"chaos seed {seed} (rerun with CHAOS_SEED={seed})")
    chooser = random.Random(seed)
    flags = JOBS[job]
    straight = tmp_path / "uninterrupted"
    started = time.monotonic()
    code, stderr = finish(launch(straight, flags, tmp_path / "uninterrupted.log"), tmp_path / "uninterrupted.log")
    assert code == 0, f"seed {seed}: {stderr[-3000:]}"
    run_s = time.monotonic() - started

    output, history = tmp_path / "chaos", []
    for attempt in range(MAX_FAULTS + 1):  # the last attempt runs undisturbed
        log = tmp_path / f"attempt-{attempt}.log"
        process = launch(output, flags, log)
        what = "undisturbed"
        if attempt < MAX_FAULTS:
            moment, fault = chooser.uniform(0.3, run_s), chooser.choice(FAULTS)
            try:
                process.wait(timeout=moment)
                what = f"ended before {fault} at {moment:.1f}s"
            except subprocess.TimeoutExpired:
                inflict(fault, process, chooser)
                what = f"{fault} at {moment:.1f}s"
        code, stderr = finish(process, log)
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
