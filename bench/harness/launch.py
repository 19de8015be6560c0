"""Starting the trainer and the suite's own workers as processes (through devtools/processes.py, which the
tests use too), and reading what they wrote."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.measure import median
from devtools.processes import REPO_ROOT, clean_env, torchrun_command

# Every trainer run of the suite: no terminal output, no TensorBoard writer, a fresh start, and one
# thread per rank, the setting all figures compare at (two ranks on two cores).
TRAINER_QUIET = ("--progress", "off", "--no-tensorboard", "--resume", "none", "--threads-per-rank", "1")


class BenchError(RuntimeError):
    """A measured run failed; the message carries the command and the end of its output."""


@dataclass(frozen=True)
class TrainerRun:
    launched_at: float  # time.time() just before the launch
    records: list[dict[str, Any]]  # metrics.jsonl
    summary: dict[str, Any]  # summary.json ({} if the run wrote none)

    def train_records(self) -> list[dict[str, Any]]:
        return [record for record in self.records if record["kind"] == "train"]

    def peak_memory_gib(self) -> float | None:
        """The most GPU memory any rank had allocated at once (summary.json); None on the CPU."""
        peaks = [rank["peak_memory_gib"] for rank in self.summary.get("ranks", []) if "peak_memory_gib" in rank]
        return max(peaks) if peaks else None

    def steady_samples_per_s(self, warmup_records: int = 1) -> float:
        """Median throughput of the logged windows after the first ones (start-up, cold caches)."""
        windows = self.train_records()[warmup_records:]
        if not windows:
            raise BenchError(f"the trainer logged {len(self.train_records())} training windows, need more than "
                             f"{warmup_records}: raise --max-steps or lower --log-every")
        return median([record["samples_per_s"] for record in windows])


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in os.environ for the block, then as they were: for this process's own clients (s3fs reads an S3
    server's endpoint and credentials there) and the processes it starts (clean_env copies os.environ)."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run(cmd: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None,
        cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    """Run to completion with the output captured; BenchError (with the output's end) unless it exits 0."""
    try:
        done = subprocess.run(list(cmd), env=clean_env(env), cwd=cwd, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as expired:
        raise BenchError(f"{_short(cmd)} ran past {timeout_s:.0f} s; output:\n{_tail(expired.stderr)}") from None
    if done.returncode != 0:
        raise BenchError(f"{_short(cmd)} exited with {done.returncode}:\n{_tail(done.stderr or done.stdout)}")
    return done


def run_trainer(args: Sequence[str], output_dir: Path, nproc: int | None, timeout_s: float,
                quiet: Sequence[str] = TRAINER_QUIET) -> TrainerRun:
    """The trainer on this machine: one plain process (nproc None) or nproc ranks under torchrun."""
    trainer_args = [*quiet, "--output-dir", str(output_dir), *args]
    cmd = ([sys.executable, "-m", "trainer", *trainer_args] if nproc is None
           else torchrun_command(nproc, "trainer", trainer_args))
    launched_at = time.time()
    run(cmd, timeout_s)
    summary = output_dir / "summary.json"
    return TrainerRun(launched_at, read_metrics(output_dir / "metrics.jsonl"),
                      json.loads(summary.read_text()) if summary.is_file() else {})


def fashion_mnist_convnet_args(steps: int, log_every: int) -> list[str]:
    """The trainer's side of the loop comparisons (figures 1, 3, 10): the ConvNet on Fashion-MNIST, batch 128 per
    rank, ``steps`` optimizer steps with a metrics window every ``log_every``."""
    return ["--dataset", "fashion-mnist", "--epochs", "1", "--max-steps", str(steps), "--log-every", str(log_every),
            "--max-test-samples", "512", "--batch-size", "128"]


def steady_windows(command: Sequence[str], out: Path, timeout_s: float) -> float:
    """Run a worker that writes its windows' samples/s to ``out`` as JSON; the median after the first window."""
    run(command, timeout_s)
    return median(json.loads(out.read_text())[1:])


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise BenchError(f"no metrics at {path}: the run wrote none")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_step_time(records: list[dict[str, Any]]) -> float:
    """Wall-clock time of the first training record (with --log-every 1: right after the first step)."""
    for record in records:
        if record["kind"] == "train":
            return float(record["time"])
    raise BenchError("no training record: the run stopped before its first step")


def _short(cmd: Sequence[str]) -> str:
    text = " ".join(cmd)
    return text if len(text) < 300 else text[:300] + " ..."


def _tail(output: str | bytes | None, lines: int = 15) -> str:
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    return "\n".join((output or "").strip().splitlines()[-lines:])
