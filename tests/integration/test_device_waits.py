"""The training loop never waits for the device between log steps (CPU test; the GPU suite checks the same
with CUDA's own sync detector). Two real ranks; each records its stop votes and host reads in order
(tests/workers/device_waits.py): between two votes lies exactly one optimizer step."""

from __future__ import annotations

import json
import re

from devtools.processes import env_ranks, torchrun

LOG_EVERY = 4
STEPS = 16  # 2 ranks x 8 samples a step, 256 samples: one epoch


def test_one_stop_vote_per_step_and_no_host_read_outside_log_steps(tmp_path):
    events_file = tmp_path / "events"
    ranks = env_ranks([str(events_file), "--dataset", "synthetic", "--synthetic-train-size", "256",
                       "--synthetic-test-size", "32", "--batch-size", "8", "--epochs", "1", "--log-every",
                       str(LOG_EVERY), "--progress", "on", "--no-tensorboard", "--output-dir", str(tmp_path / "run")],
                      world_size=2, module="tests.workers.device_waits", timeout_s=180)
    for result in ranks:
        assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["global_step"] == STEPS
    assert "step 16/16" in ranks[0].stderr or "16/16" in ranks[0].stderr, "the progress bar was shown"
    for rank in range(2):
        events = json.loads((tmp_path / f"events.rank{rank}").read_text())
        assert events.count("vote") == STEPS, "one stop vote per optimizer step"
        # Reads between vote k-1 and vote k belong to step k (its forward, backward, optimizer step and, at a
        # log step, its metrics line); before the first vote lies the set-up and step 1, after the last the
        # evaluation and the checkpoint.
        segments = " ".join(events).split("vote")[1:-1]
        reads = {step: segment.split().count("read") for step, segment in enumerate(segments, start=2)}
        log_steps = {step for step in reads if step % LOG_EVERY == 0}
        assert {step: n for step, n in reads.items() if step not in log_steps} == dict.fromkeys(
            sorted(set(reads) - log_steps), 0), f"rank {rank}: host reads per step {reads}"
        assert all(reads[step] > 0 for step in log_steps), f"rank {rank}: a log step reads its metrics: {reads}"


def test_the_control_group_is_gloo_whatever_the_training_backend_reports_each_rank():
    """The worker the GPU suite runs on one GPU with NCCL (tests/gpu), run here on CPU: it reports both groups."""
    result = torchrun(["cpu"], nproc=2, module="tests.workers.group_backends", timeout_s=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(re.findall(r"rank (\d) training (\w+) control (\w+)", result.stdout)) == [
        ("0", "gloo", "gloo"), ("1", "gloo", "gloo")]
