"""The trainer as users start it: every entry point, seeding, evaluation, reporting, and the one-line
errors for bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from devtools.processes import BIN_DIR, REPO_ROOT, clean_env, env_ranks, free_port, kill_session, run, torchrun
from tests.support.checkpoint_reading import newest_checkpoint, summary, wait_for_checkpoint
from tests.support.preconditions import unavailable
from trainer.errors import EXIT_PEER_LOST, EXIT_RENDEZVOUS, EXIT_USAGE

# Timing-sensitive (rendezvous timeouts of 1 to 2 s): never run beside other tests (tests/conftest.py).
pytestmark = pytest.mark.serial

TINY = ["--dataset", "synthetic", "--synthetic-train-size", "192", "--synthetic-test-size", "67", "--batch-size",
        "16", "--epochs", "1", "--progress", "off", "--no-tensorboard"]
PYTHON = sys.executable


def model_of(output: Path) -> dict[str, torch.Tensor]:
    return newest_checkpoint(output / "checkpoints")[2]["model"]


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr[-2000:]
    return lines[-1]


@pytest.mark.slow
def test_module_script_and_console_command_train_the_same_model_for_the_same_seed(tmp_path):
    as_module = run([PYTHON, "-m", "trainer", *TINY, "--output-dir", str(tmp_path / "a")])
    as_script = run([PYTHON, str(REPO_ROOT / "trainer" / "main.py"), *TINY, "--output-dir", str(tmp_path / "b")],
                    cwd=tmp_path)
    console = run([str(Path(PYTHON).parent / "ddp-train"), *TINY, "--seed", "1", "--output-dir", str(tmp_path / "c")])
    for result in (as_module, as_script, console):
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().splitlines()[-1].startswith("final test accuracy")
    same, other = model_of(tmp_path / "a"), model_of(tmp_path / "c")
    assert all(torch.equal(same[key], value) for key, value in model_of(tmp_path / "b").items())
    assert not all(torch.equal(same[key], value) for key, value in other.items())


@pytest.mark.slow
def test_evaluation_counts_each_test_sample_once_for_any_world_size(tmp_path):
    trained = run([PYTHON, "-m", "trainer", *TINY, "--output-dir", str(tmp_path / "w1")])
    assert trained.returncode == 0, trained.stderr[-2000:]
    checkpoint = tmp_path / "w1" / "checkpoints" / newest_checkpoint(tmp_path / "w1" / "checkpoints")[0]
    reference = summary(tmp_path / "w1")
    assert reference["test_samples"] == 67
    for world_size in (2, 3):  # 67 test samples: shards of 34/33 and 23/22/22, no padding
        output = tmp_path / f"w{world_size}"
        evaluated = torchrun([*TINY, "--resume", str(checkpoint), "--output-dir", str(output)], nproc=world_size)
        assert evaluated.returncode == 0, evaluated.stderr[-2000:]
        result = summary(output)
        assert result["test_samples"] == 67 and result["world_size"] == world_size
        assert result["test_accuracy"] == reference["test_accuracy"]
        assert result["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-5)


@pytest.mark.slow
def test_two_plain_env_ranks_report_metrics_tensorboard_mid_epoch_evaluations_and_rank_tagged_logs(tmp_path):
    args = [*TINY, "--precision", "bf16", "--log-every", "2", "--tensorboard", "--progress", "on", "--sync-bn",
            "--synthetic-train-size", "640", "--lr", "0.003", "--eval-every", "6", "--output-dir", str(tmp_path)]
    results = env_ranks(args, world_size=2)
    for rank, result in enumerate(results):
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"[rank {rank}/2]" in result.stderr
    assert "step/s" in results[0].stderr or "s/step" in results[0].stderr  # tqdm's bar on rank 0 only
    assert "step/s" not in results[1].stderr and "s/step" not in results[1].stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    test = [r for r in records if r["kind"] == "test"]
    assert train and {"loss", "accuracy", "lr", "samples_per_s", "epoch"} <= set(train[0])
    assert test[-1]["samples"] == 67
    # 20 steps of 2 x 16 samples: --eval-every 6 evaluates mid-epoch at 6, 12, 18; the epoch's own at 20.
    assert [(r["step"], r["samples_seen"], r["samples"]) for r in test] == [(s, 32 * s, 67) for s in (6, 12, 18, 20)]
    assert "step 6 (epoch 1): test loss" in results[0].stderr
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    result = summary(tmp_path)
    assert [r["rank"] for r in result["ranks"]] == [0, 1] and result["ranks"][0]["launcher"] == "env"
    assert all("peak_memory_gib" not in r for r in result["ranks"]), "the CPU keeps no allocator peak to report"
    assert result["test_accuracy"] > 0.3  # ten classes: well above chance after 20 bf16 steps (0.76 seen)
    assert (tmp_path / "config.yaml").read_text().count("precision: bf16") == 1


def test_cuda_requested_on_a_machine_without_it_is_one_clear_error(tmp_path):
    if torch.cuda.is_available():
        unavailable("this machine has CUDA: the error for a missing one needs a machine without")
    result = run([PYTHON, "-m", "trainer", *TINY, "--device", "cuda", "--output-dir", str(tmp_path)])
    assert result.returncode == EXIT_USAGE
    assert "--device cuda but this machine has no CUDA device" in one_error_line(result.stderr)


def test_nccl_on_cpu_is_one_clear_error(tmp_path):
    result = run([PYTHON, "-m", "trainer", *TINY, "--device", "cpu", "--backend", "nccl", "--output-dir",
                  str(tmp_path)])
    assert result.returncode == EXIT_USAGE
    assert "--backend nccl needs CUDA" in one_error_line(result.stderr)


def test_inconsistent_launcher_environment_is_one_clear_error(tmp_path):
    result = run([PYTHON, "-m", "trainer", *TINY, "--output-dir", str(tmp_path)],
                 env={"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"})
    assert result.returncode == EXIT_USAGE
    assert "RANK=2 is not below WORLD_SIZE=2" in one_error_line(result.stderr)


def test_unreachable_master_ends_with_a_message_naming_address_and_port(tmp_path):
    port = free_port()  # nothing listens there
    result = run([PYTHON, "-m", "trainer", *TINY, "--rendezvous-timeout-s", "2", "--output-dir", str(tmp_path)],
                 env={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert result.returncode == EXIT_RENDEZVOUS
    line = one_error_line(result.stderr)
    assert f"master 127.0.0.1:{port} not reachable after 2s" in line and "attempts" in line


def test_unresolvable_master_host_is_retried_then_named(tmp_path):
    result = run([PYTHON, "-m", "trainer", *TINY, "--rendezvous-timeout-s", "1", "--output-dir", str(tmp_path)],
                 env={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"})
    assert result.returncode == EXIT_RENDEZVOUS
    assert "host name 'no-such-host.invalid' does not resolve" in one_error_line(result.stderr)


def test_a_master_name_that_resolves_only_after_some_seconds_is_waited_for_then_joined(tmp_path):
    # Rank 1 sees a hosts file of its own (a mount namespace) that names the master only 3 s in: a pod's DNS
    # record appears some seconds after the pod.
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    port = free_port()
    args = [*TINY, "--rendezvous-timeout-s", "60", "--output-dir", str(tmp_path / "run")]
    master = subprocess.Popen([PYTHON, "-m", "trainer", *args], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=clean_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                             "MASTER_PORT": str(port)}))
    script = (f"mount --bind {hosts} /etc/hosts || exit 97; getent hosts late-master || echo 'late-master does not "
              f"resolve yet'; exec {PYTHON} -m trainer {' '.join(args)}")
    worker = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=clean_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "late-master",
                                             "MASTER_PORT": str(port)}))
    try:
        time.sleep(3)
        if worker.poll() is not None:
            _, err = worker.communicate()
            unavailable(f"cannot give a process a hosts file of its own (needs root to unshare and mount): {err}")
        with hosts.open("a") as file:
            file.write("127.0.0.1 late-master\n")
        outs = [process.communicate(timeout=120) for process in (master, worker)]
    finally:
        for process in (master, worker):
            kill_session(process)
    assert [master.returncode, worker.returncode] == [0, 0], outs[1][1][-3000:]
    assert "late-master does not resolve yet" in outs[1][0]
    assert "final test accuracy" in outs[0][0]


@pytest.mark.slow
def test_when_a_rank_dies_the_other_exits_retryable_with_one_line_not_a_hang(tmp_path):
    port = free_port()
    args = [*TINY, "--synthetic-train-size", "20000", "--checkpoint-every", "5", "--output-dir", str(tmp_path)]
    procs = [subprocess.Popen([PYTHON, "-m", "trainer", *args], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=clean_env({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                             "MASTER_PORT": str(port)}))
             for rank in range(2)]
    wait_for_checkpoint(tmp_path / "checkpoints", procs[1])
    os.kill(procs[0].pid, signal.SIGKILL)
    _, stderr = procs[1].communicate(timeout=120)
    procs[0].communicate()
    assert procs[1].returncode == EXIT_PEER_LOST, stderr[-2000:]
    assert "lost contact with another rank" in one_error_line(stderr)


def test_the_console_command_finds_a_task_in_the_current_directory(tmp_path):
    """`python -m trainer` has the current directory on sys.path and `ddp-train` would not; both find it."""
    shutil.copy(REPO_ROOT / "tests" / "support" / "broken_tasks.py", tmp_path / "mytasks.py")
    result = run([str(BIN_DIR / "ddp-train"), "--task", "mytasks:TinyTask", "--epochs", "1", "--batch-size", "8",
                  "--progress", "off", "--no-tensorboard", "--output-dir", str(tmp_path / "out")], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(tmp_path / "out")["task"] == "tiny"
