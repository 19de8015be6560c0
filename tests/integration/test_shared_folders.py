"""Folders that several jobs can reach: a checkpoint folder belongs to one job at a time (a second one is
refused while the first runs, a killed one's lease expires, a sequential re-run resumes)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from devtools.processes import REPO_ROOT, clean_env, kill_session, run
from tests.support.checkpoint_reading import wait_for_checkpoint
from trainer.errors import EXIT_USAGE

EXPIRY_S = 15  # a refused start after the kill takes 2-3 s, 8 s and more on a loaded machine; short to wait for
# A run that goes on for minutes unless stopped: 1 step per epoch, a checkpoint at every step.
TINY = ["--dataset", "synthetic", "--synthetic-train-size", "32", "--synthetic-test-size", "16", "--batch-size", "32",
        "--progress", "off", "--no-tensorboard", "--checkpoint-every", "1", "--lease-expiry-s", str(EXPIRY_S)]


def trainer(output: Path, checkpoints: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer", *TINY, "--output-dir", str(output), "--checkpoint-dir", str(checkpoints),
            *extra]


def test_a_second_job_on_a_folder_in_use_is_refused_and_a_killed_jobs_lease_expires(tmp_path):
    shared = tmp_path / "checkpoints"
    first = subprocess.Popen(trainer(tmp_path / "first", shared, "--epochs", "10000"), env=clean_env(), cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_checkpoint(shared, first)
        second = run(trainer(tmp_path / "second", shared, "--epochs", "2"), timeout_s=120)
        assert second.returncode == EXIT_USAGE, second.stderr[-3000:]
        refusal = second.stderr.strip().splitlines()[-1]
        assert f"checkpoint folder {shared} is in use by another job (process-" in refusal, refusal
        assert "pass --take-over-checkpoint-dir" in refusal and "Traceback" not in second.stderr
        assert first.poll() is None, "the running job is untouched"
        first.send_signal(signal.SIGKILL)  # no chance to release its lease
        first.wait(timeout=30)
    finally:
        kill_session(first)
    newest = sorted(shared.glob("step-*"))[-1].name
    step = int(newest.removeprefix("step-"))
    killed_at = time.monotonic()
    refused = run(trainer(tmp_path / "third", shared, "--epochs", "2"), timeout_s=120)
    assert time.monotonic() - killed_at < EXPIRY_S - 2.5, "the machine is too slow for this test's timing"
    assert refused.returncode == EXIT_USAGE and "is in use by another job" in refused.stderr, refused.stderr[-2000:]
    time.sleep(max(0.0, EXPIRY_S + 0.5 - (time.monotonic() - killed_at)))
    taken = run(trainer(tmp_path / "fourth", shared, "--epochs", "10000", "--max-steps", str(step + 1)),
                timeout_s=120)
    assert "whose lease expired" in taken.stderr and f"resumed from {shared / newest}" in taken.stderr, \
        taken.stderr[-3000:]
    # A sequential re-run finds the lease released and resumes, no warning.
    again = run(trainer(tmp_path / "fifth", shared, "--epochs", "10000", "--max-steps", str(step + 2)), timeout_s=120)
    assert again.returncode == 0 and "took over the lease" not in again.stderr, again.stderr[-3000:]
    assert f"resumed from {shared / f'step-{step + 1:08d}'}" in again.stderr, again.stderr[-3000:]
