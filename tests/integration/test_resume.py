"""Exact resume: interrupted runs (stopped, preempted with SIGTERM, killed under torchrun --max-restarts)
end with the very same parameters and optimizer state as one uninterrupted run, bitwise, on CPU."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from devtools.processes import REPO_ROOT, TORCHRUN, clean_env, free_port, torchrun
from tests.support.checkpoint_reading import assert_same_tensors, newest_checkpoint, summary, wait_for_checkpoint
from trainer.errors import EXIT_PREEMPTED

# 2 ranks x 16 samples: 10 steps per epoch, 20 in all; checkpoints every 3 steps land mid-epoch.
COMMON = ["--dataset", "synthetic", "--synthetic-train-size", "320", "--synthetic-test-size", "64",
          "--batch-size", "16", "--epochs", "2", "--progress", "off", "--no-tensorboard", "--checkpoint-every", "3",
          "--log-every", "5"]
# With three ranks the order in which an all-reduce adds up the ranks' gradients changes the last bits (with
# two, a + b == b + a): the stop-and-resume test runs three, 480 samples keep it at 10 steps an epoch.
THREE_RANKS = 3, ["--synthetic-train-size", "480"]


def run_args(output_dir: Path, *extra: str) -> list[str]:
    return [*COMMON, "--output-dir", str(output_dir), *extra]


def final_state(output_dir: Path) -> dict:
    _, manifest, state = newest_checkpoint(output_dir / "checkpoints")
    assert manifest["step"] == 20 and manifest["epoch"] == 2
    return {"model": state["model"], "optimizer": state["optimizer"], "position": state["position"]}


def uninterrupted(output: Path, nproc: int, *extra: str) -> dict:
    result = torchrun(run_args(output, *extra), nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return final_state(output)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One uninterrupted run of two ranks that every interrupted one must reproduce."""
    return uninterrupted(tmp_path_factory.mktemp("reference"), 2)


def test_stopping_and_resuming_twice_mid_epoch_gives_identical_parameters(tmp_path):
    nproc, sizes = THREE_RANKS
    reference = uninterrupted(tmp_path / "reference", nproc, *sizes)
    for stop_at in (7, 14):  # inside epoch 1, then inside epoch 2
        stopped = torchrun(run_args(tmp_path / "run", *sizes, "--max-steps", str(stop_at)), nproc=nproc)
        assert stopped.returncode == 0, stopped.stderr[-3000:]
        _, manifest, _ = newest_checkpoint(tmp_path / "run" / "checkpoints")
        assert manifest["step"] == stop_at and manifest["samples_in_epoch"] > 0
    finished = torchrun(run_args(tmp_path / "run", *sizes), nproc=nproc)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert summary(tmp_path / "run")["resumed_from"].endswith("step-00000014")
    assert_same_tensors(final_state(tmp_path / "run"), reference)


def _start_torchrun(output_dir: Path, *torchrun_args: str) -> subprocess.Popen:
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", *torchrun_args, "-m", "trainer", *run_args(output_dir)]
    return subprocess.Popen(cmd, env=clean_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def test_sigterm_writes_a_checkpoint_exits_retryable_and_resumes_exactly(reference, tmp_path):
    process = _start_torchrun(tmp_path)
    wait_for_checkpoint(tmp_path / "checkpoints", process)
    process.send_signal(signal.SIGTERM)  # what torchrun receives from Kubernetes or docker stop
    _, stderr = process.communicate(timeout=120)
    assert f"exiting with {EXIT_PREEMPTED}" in stderr, stderr[-3000:]
    stopped_at = {int(step) for step in re.findall(r"preempted at step (\d+); checkpoint written", stderr)}
    name, manifest, _ = newest_checkpoint(tmp_path / "checkpoints")
    # The checkpoint of the step the ranks stopped at, not the last periodic one (every 3 steps, before it).
    assert stopped_at == {manifest["step"]} and 0 < manifest["step"] < 20, (stopped_at, name)
    resumed = torchrun(run_args(tmp_path), nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(tmp_path)["resumed_from"].endswith(name)
    assert_same_tensors(final_state(tmp_path), reference)


def _worker_pid(agent_pid: int, rank: int) -> int:
    """The torchrun worker with RANK=rank among the agent's children."""
    for pid in _children(agent_pid):
        if _rank_of(pid) == rank:
            return pid
    raise AssertionError(f"no worker with RANK={rank} under torchrun pid {agent_pid}")


def test_a_killed_rank_is_restarted_by_torchrun_and_the_job_ends_identical(reference, tmp_path):
    process = _start_torchrun(tmp_path, "--max-restarts=2")
    wait_for_checkpoint(tmp_path / "checkpoints", process)
    os.kill(_worker_pid(process.pid, rank=1), signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    assert "resumed from" in stderr
    assert summary(tmp_path)["resumed_from"] is not None
    assert_same_tensors(final_state(tmp_path), reference)


def test_a_killed_rank_on_one_of_two_nodes_restarts_both_nodes_and_the_job_ends_identical(reference, tmp_path):
    """Two torchrun agents (nodes) with c10d rendezvous: node 1's worker dies, node 1 counts a restart and
    node 0 only sees a new round; the restarted ranks must still find each other (not old addresses)."""
    port = free_port()
    agents = [subprocess.Popen(
        [*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         "--rdzv-id=two-nodes", "--max-restarts=2", "-m", "trainer", *run_args(tmp_path)],
        env=clean_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True) for _ in range(2)]
    wait_for_checkpoint(tmp_path / "checkpoints", agents[0])
    killed = next(pid for agent in agents for pid in _children(agent.pid) if _rank_of(pid) == 1)
    os.kill(killed, signal.SIGKILL)
    outputs = [agent.communicate(timeout=300) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert summary(tmp_path)["resumed_from"] is not None
    assert_same_tensors(final_state(tmp_path), reference)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=True).stdout
    return [int(child) for child in out.split()]


def _rank_of(pid: int) -> int | None:
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"RANK="):
            return int(entry[5:])
    return None


def test_a_channels_last_async_run_with_the_fused_optimizer_resumes_bitwise_in_its_layout(tmp_path):
    """Channels-last parameters (as on a GPU), the fused AdamW (the default) and asynchronous saves: the
    optimizer's moments are saved and restored in their parameters' layout. The resume passes
    --channels-last auto, which on this CPU would mean off: it keeps the checkpoint's layout, as a GPU
    checkpoint resumed on a CPU does, and ends bitwise like the uninterrupted run."""
    layout = ["--channels-last", "on", "--async-checkpoint"]
    reference = uninterrupted(tmp_path / "reference", 2, *layout)
    assert reference["model"]["features.0.weight"].is_contiguous(memory_format=torch.channels_last)
    stopped = torchrun(run_args(tmp_path / "run", *layout, "--max-steps", "9"), nproc=2)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    _, manifest, state = newest_checkpoint(tmp_path / "run" / "checkpoints")
    assert manifest["step"] == 9 and manifest["samples_in_epoch"] > 0
    moments = [value for entry in state["optimizer"]["state"].values() for value in entry.values()
               if isinstance(value, torch.Tensor) and value.dim() == 4]
    assert moments and all(m.is_contiguous(memory_format=torch.channels_last) for m in moments)
    shutil.copytree(tmp_path / "run" / "checkpoints", tmp_path / "switched" / "checkpoints")
    resumed = torchrun(run_args(tmp_path / "run", "--channels-last", "auto", "--async-checkpoint"), nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(tmp_path / "run")["resumed_from"].endswith("step-00000009")
    assert_same_tensors(final_state(tmp_path / "run"), reference)
    # Asked for the other layout, the resume obeys and says what that costs.
    switched = torchrun(run_args(tmp_path / "switched", "--channels-last", "off"), nproc=2)
    assert switched.returncode == 0, switched.stderr[-3000:]
    assert "the checkpoint was trained channels-last on and this run trains off" in switched.stderr
    final = final_state(tmp_path / "switched")
    assert final["model"]["features.0.weight"].is_contiguous()
    assert all(value.is_contiguous() for entry in final["optimizer"]["state"].values() for value in entry.values())


def test_sigterm_to_one_rank_only_stops_every_rank_at_the_same_step_and_resumes_exactly(reference, tmp_path):
    """What a node's own preemption does (only its processes are signalled): the ranks agree on the stop by
    their vote, write one checkpoint of the same step and all exit 143."""
    process = _start_torchrun(tmp_path)
    wait_for_checkpoint(tmp_path / "checkpoints", process)
    os.kill(_worker_pid(process.pid, rank=1), signal.SIGTERM)  # rank 1 alone; torchrun and rank 0 are not told
    _, stderr = process.communicate(timeout=120)
    stops = re.findall(r"\[rank (\d)\] preempted at step (\d+); checkpoint written; exiting with 143", stderr)
    assert sorted(rank for rank, _ in stops) == ["0", "1"], stderr[-3000:]
    [(step)] = {int(step) for _, step in stops}
    name, manifest, _ = newest_checkpoint(tmp_path / "checkpoints")
    assert manifest["step"] == step and 0 < step < 20, (name, step)
    resumed = torchrun(run_args(tmp_path), nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(tmp_path)["resumed_from"].endswith(name)
    assert_same_tensors(final_state(tmp_path), reference)
