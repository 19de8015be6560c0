"""--profile-steps A-B: a torch.profiler trace per rank that covers exactly the asked optimizer steps."""

from __future__ import annotations

import json
import re
import sys

from devtools.processes import run, torchrun

ARGS = ["--dataset", "synthetic", "--synthetic-train-size", "96", "--synthetic-test-size", "16", "--batch-size", "8",
        "--epochs", "1", "--max-steps", "4", "--progress", "off", "--no-tensorboard"]


def test_each_rank_writes_a_trace_of_the_asked_steps_and_logs_where(tmp_path):
    result = torchrun([*ARGS, "--profile-steps", "2-3", "--output-dir", str(tmp_path)], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        trace = tmp_path / "profiles" / f"rank-{rank}.pt.trace.json"
        assert f"--profile-steps 2-3: wrote {trace}" in result.stderr, result.stderr[-3000:]
        events = json.loads(trace.read_text())["traceEvents"]
        steps = sorted({int(match.group(1)) for event in events
                        if (match := re.fullmatch(r"ProfilerStep#(\d+)", str(event.get("name", ""))))})
        assert steps == [2, 3], steps
        # What ran inside them: the model's forward and backward and the optimizer's update, with durations.
        names = {str(event.get("name", "")) for event in events}
        assert any(name.startswith("aten::conv") for name in names) and any("Optimizer.step" in name for name in names)


def test_a_range_past_the_end_is_written_at_the_end_and_a_bad_range_is_one_line(tmp_path):
    late = torchrun([*ARGS, "--profile-steps", "3-99", "--output-dir", str(tmp_path / "late")], nproc=1)
    assert late.returncode == 0, late.stderr[-3000:]
    assert (tmp_path / "late" / "profiles" / "rank-0.pt.trace.json").is_file()
    for bad in ("3-2", "0-1", "2", "a-b"):
        refused = run([sys.executable, "-m", "trainer", *ARGS, "--profile-steps", bad, "--output-dir",
                       str(tmp_path / "bad")])
        assert refused.returncode == 2
        assert refused.stderr.strip().splitlines()[-1] == (
            f"[rank 0] error: --profile-steps must be A-B, optimizer steps with 1 <= A <= B (for example 10-12), "
            f"got '{bad}'"), refused.stderr[-2000:]


def test_running_out_of_memory_is_one_line_naming_the_step_and_what_to_change(tmp_path):
    # CUDA's error, raised by the task on the CPU (tests/gpu runs out of a real GPU's memory, snapshot included).
    result = run([sys.executable, "-m", "trainer", "--task", "tests.support.tasks:OutOfMemoryTask", "--batch-size", "8",
                  "--epochs", "1", "--progress", "off", "--no-tensorboard", "--output-dir", str(tmp_path),
                  "--memory-snapshot-on-oom"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "[rank 0] error: out of memory at optimizer step 3 (CUDA out of memory. Tried to allocate 16.00 TiB. GPU 0 "
        "has a total capacity of 0 bytes (raised by the test task on the CPU)); lower --batch-size (with "
        "--grad-accum-steps to keep the effective batch), use --precision bf16, or shard the model with --sync fsdp; "
        "--memory-snapshot-on-oom records what held the memory"), result.stderr[-3000:]
    warning = "--memory-snapshot-on-oom records CUDA's allocator; this run is on cpu, so it records nothing"
    assert warning in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "profiles").exists()
