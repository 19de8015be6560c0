"""Long work is not a lost peer, a stalled peer is named as one, and signals during a slow save: real
processes, checkpoints on storage that writes slowly (tests/workers/slow_storage.py)."""

from __future__ import annotations

import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from devtools.processes import REPO_ROOT, clean_env, env_ranks, free_port, kill_session, run, torchrun_command
from trainer.checkpoint import CheckpointStorage, open_storage, verify
from trainer.checkpoint.storage import MANIFEST, step_of
from trainer.errors import EXIT_PEER_LOST, EXIT_PREEMPTED

# Timing-sensitive (collective timeouts of 3 to 4 s): never run beside other tests (tests/conftest.py).
pytestmark = pytest.mark.serial

TINY = ["--dataset", "synthetic", "--synthetic-train-size", "64", "--synthetic-test-size", "16", "--batch-size", "16",
        "--progress", "off", "--no-tensorboard"]
SLOW = "tests.workers.slow_storage"


class Started:
    """A process whose stderr is read as it comes, so that a test can wait for a line and then act."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(cmd, env=clean_env(env), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, text: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.process.poll() is None, f"ended before {text!r}: {self.stderr[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in: {self.stderr[-3000:]}"
            time.sleep(0.02)

    def finish(self, timeout_s: float = 120) -> tuple[int, float]:
        """The exit code and how long the process took to end from now."""
        started = time.monotonic()
        try:
            code = self.process.wait(timeout=timeout_s)
        finally:
            kill_session(self.process)
        self._reader.join(timeout=10)
        return code, time.monotonic() - started


def committed(storage: CheckpointStorage) -> list[str]:
    """The folders whose save was committed (its manifest written), newest first."""
    return [name for name in storage.list_checkpoints() if storage.exists(name, MANIFEST)]


def test_a_save_that_outlasts_the_collective_timeout_is_waited_for_not_taken_for_a_lost_peer(tmp_path):
    # Rank 0 writes for 6 s; the other rank's collectives time out after 3 s, but it waits in the store
    # while rank 0's heartbeat goes on.
    cmd = torchrun_command(2, SLOW, [*TINY, "--epochs", "1", "--collective-timeout-s", "3", "--output-dir",
                                     str(tmp_path), "--checkpoint-dir", f"slowfile://{tmp_path}/checkpoints"])
    result = run(cmd, env={"SLOW_SAVE_S": "6"}, timeout_s=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "slow write started" in result.stderr  # slowfile:// is fsspec's: each save a folder of its own
    assert re.search(r"/step-00000002\.[0-9a-f]{32} written \(0\.4 MB in 6\.", result.stderr), result.stderr[-3000:]


def two_ranks(tmp_path: Path, collective_timeout_s: int) -> list[Started]:
    """Two plain ranks training for ever, a checkpoint every step."""
    port = free_port()
    return [Started([sys.executable, "-m", "trainer", *TINY, "--epochs", "100000", "--collective-timeout-s",
                     str(collective_timeout_s), "--checkpoint-every", "1", "--output-dir", str(tmp_path)],
                    {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for rank in (0, 1)]


def stop_one_and_wait_for_the_other(ranks: list[Started], stopped: int) -> tuple[str, float]:
    """SIGSTOP rank ``stopped`` (alive, its sockets open, silent) once training runs; the other's error line
    once it exited 200, and how long that took."""
    waiting = ranks[1 - stopped]
    try:
        ranks[0].wait_for_line("checkpoint ")
        ranks[stopped].process.send_signal(signal.SIGSTOP)
        code, took_s = waiting.finish(timeout_s=60)
    finally:
        for started in ranks:
            kill_session(started.process)
    assert code == EXIT_PEER_LOST, waiting.stderr[-3000:]
    error = waiting.stderr.strip().splitlines()[-1]
    assert f"exiting with {EXIT_PEER_LOST}" in error and "Traceback" not in waiting.stderr, waiting.stderr[-3000:]
    return error, took_s


def test_a_stalled_peer_is_named_as_stalled_and_the_job_exits_retryable(tmp_path):
    error, took_s = stop_one_and_wait_for_the_other(two_ranks(tmp_path, 4), stopped=1)
    assert "timed out after 4s (--collective-timeout-s): rank 1 stopped responding (no heartbeat for 3s" in error, error
    assert "stopped or frozen" in error
    assert took_s < 4 + 3 + 20, took_s  # the timeout, the diagnosis, start-up slack: not a hang
    for step in open_storage(str(tmp_path / "checkpoints")).list_checkpoints():
        verify(open_storage(str(tmp_path / "checkpoints")), step)  # every checkpoint left is whole


def test_a_stalled_rank_0_which_hosts_the_store_is_named_too_without_a_hang(tmp_path):
    error, took_s = stop_one_and_wait_for_the_other(two_ranks(tmp_path, 4), stopped=0)
    # Stopped during a step (a collective times out) or during its checkpoint work (the others wait in the store).
    assert ("timed out after 4s (--collective-timeout-s), and rank 0, which hosts the job's store, does not answer "
            "either: it is stopped, frozen or gone" in error) or (
        "rank 0, which hosts the job's store, did not answer for 5s: it is stopped, frozen or gone (while the "
        "others waited for rank 0's checkpoint work)" in error), error
    assert took_s < 4 + 5 + 20, took_s  # the timeout, one store read's timeout, slack


def test_the_grace_period_running_out_during_a_save_exits_retryable_and_keeps_the_last_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    started = Started([sys.executable, "-m", SLOW, *TINY, "--epochs", "100000", "--checkpoint-every", "1",
                       "--grace-period-s", "2", "--output-dir", str(tmp_path), "--checkpoint-dir",
                       f"slowfile://{checkpoints}"], {"SLOW_AFTER": "2", "SLOW_SAVE_S": "60"})
    started.wait_for_line("slow write started")  # the third save hangs on the storage
    started.process.send_signal(signal.SIGTERM)
    code, took_s = started.finish(timeout_s=60)
    assert code == EXIT_PREEMPTED and took_s < 2 + 5, (code, took_s, started.stderr[-3000:])
    assert "grace period of 2s over before the checkpoint finished; exiting with 143" in started.stderr
    storage = open_storage(str(checkpoints))
    saved = committed(storage)  # the third save's folder, unfinished, is removed by the next start
    assert [step_of(name) for name in saved] == [2, 1] and verify(storage, saved[0]).manifest["step"] == 2
    # Its lease was released on the way out: the next job on the folder starts at once and resumes.
    again = run([sys.executable, "-m", SLOW, *TINY, "--epochs", "100000", "--max-steps", "3", "--output-dir",
                 str(tmp_path), "--checkpoint-dir", f"slowfile://{checkpoints}"], env={"SLOW_SAVE_S": "0"})
    assert again.returncode == 0 and "resumed from slowfile://" in again.stderr, again.stderr[-3000:]


def test_a_second_signal_during_a_save_exits_at_once_keeping_the_last_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    started = Started([sys.executable, "-m", SLOW, *TINY, "--epochs", "100000", "--checkpoint-every", "1",
                       "--grace-period-s", "60", "--output-dir", str(tmp_path), "--checkpoint-dir",
                       f"slowfile://{checkpoints}"], {"SLOW_AFTER": "1", "SLOW_SAVE_S": "60"})
    started.wait_for_line("slow write started")
    started.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert started.process.poll() is None, "the first signal waits for the save (grace period 60 s)"
    started.process.send_signal(signal.SIGINT)  # a person pressing Ctrl-C again
    code, took_s = started.finish(timeout_s=30)
    assert code == EXIT_PREEMPTED and took_s < 5, (code, took_s, started.stderr[-3000:])
    assert "second SIGINT: exiting now without a new checkpoint" in started.stderr
    assert [step_of(name) for name in committed(open_storage(str(checkpoints)))] == [1]


def test_a_rank_stuck_outside_any_collective_ends_itself_with_a_diagnosis_and_a_flight_recorder_dump(tmp_path):
    """Rank 1 hangs inside its step (tests.support.tasks:HangsTask). Rank 0's collective times out after 4 s:
    it names the timeout and writes its flight-recorder dump, exit 200. Rank 1, where nothing times out, is
    ended by its progress watchdog 10 s later, with its own diagnosis and dump, exit 200: on NCCL, whose
    watchdog would abort it with neither, NCCL's timeout is placed a minute after."""
    args = ["--task", "tests.support.tasks:HangsTask", "--batch-size", "4", "--epochs", "1", "--progress", "off",
            "--no-tensorboard", "--collective-timeout-s", "4", "--output-dir", str(tmp_path)]
    started = time.monotonic()
    ranks = env_ranks(args, world_size=2, timeout_s=120)
    took = time.monotonic() - started
    assert [result.returncode for result in ranks] == [EXIT_PEER_LOST, EXIT_PEER_LOST], ranks[1].stderr[-3000:]
    assert took < 60, took
    lines = [[line for line in result.stderr.splitlines() if "error:" in line] for result in ranks]
    assert [len(found) for found in lines] == [1, 1] and "Traceback" not in ranks[1].stderr, lines
    assert "timed out after 4s (--collective-timeout-s): rank 1 is alive at step 2 but behind this rank inside it " \
           "(stuck in its forward pass or loss" in lines[0][0]
    assert re.search(r"rank 1's training made no progress for 1\ds at step \d+ \(stuck waiting for a device",
                     lines[1][0]), lines[1][0]
    folder = tmp_path / "flight-recorder"
    for rank, [line] in enumerate(lines):
        assert f"each rank's last collectives are in {folder}/rank-N (compare them with `torchfrtrace {folder} " \
               f"-p rank-`" in line, line
        record = pickle.loads((folder / f"rank-{rank}").read_bytes())
        assert record["entries"] and all(entry["profiling_name"].startswith("gloo:") for entry in record["entries"])
    # Rank 0's record ends with the collective rank 1 never joined: started, never completed.
    assert pickle.loads((folder / "rank-0").read_bytes())["entries"][-1]["state"] != "completed"
