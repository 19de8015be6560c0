"""Figure 17: how long a preemption takes, from SIGTERM to exit 143, by the size of the training state, on a local
disk and on an S3-compatible store (moto's server on loopback, through s3fs), against a raw write of the same bytes
to the same place; the numbers the rule for a pod's terminationGracePeriodSeconds is made of (docs/kubernetes.md,
"Preemption that fits the grace period").

The trainer itself, one process: the built-in ConvNet on synthetic 1x64x64 images with as many classes as make the
state (parameters and AdamW's two moments, 12 bytes a parameter) the chosen size, batch 8. It is stopped with SIGTERM
after its third logged step and timed until it exits; the exit code must be 143 (checkpoint written). Measured per
run: SIGTERM to exit (to the next step boundary, the save, the lease's release, the interpreter's exit), the save
alone (the trainer's own log line), the longest step after the first, and the raw write: the same number of bytes
written and fsynced in the run's folder, or put as one object into the same bucket. A last run gives the largest
state a --grace-period-s shorter than its save to the store: the trainer gives up at the grace period, exits 143
without a new checkpoint, and the row reports how long after the grace period it exited (the forced exit's own
lease release, bounded at 2 s, and the process's end: the margin a pod's grace period needs above the trainer's).
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.context import Context
from bench.harness.launch import TRAINER_QUIET, BenchError, environment, read_metrics
from bench.harness.measure import load_average
from bench.harness.results import FigureResult, Row
from devtools.processes import REPO_ROOT, clean_env
from devtools.s3_server import s3_server
from trainer.checkpoint import open_storage
from trainer.errors import EXIT_PREEMPTED

TITLE = "Preemption: SIGTERM to exit 143"

IMAGE_SIDE = 64
FEATURES = 32 * (IMAGE_SIDE // 4) ** 2  # the ConvNet's linear layer's inputs at 64x64
BYTES_PER_PARAMETER = 12  # fp32 parameter + AdamW's exp_avg and exp_avg_sq
BATCH = 8
STEPS_BEFORE_SIGNAL = 3
SAVED = re.compile(r"checkpoint \S+ written \(([\d.]+) MB in ([\d.]+)s\)")
GAVE_UP = "grace period of"


def classes_for(state_mb: float) -> int:
    """The synthetic classes that make the ConvNet's state about ``state_mb`` megabytes."""
    return max(2, round(state_mb * 1e6 / BYTES_PER_PARAMETER / (FEATURES + 1)))


def _trainer_command(output_dir: Path, checkpoint_dir: str, classes: int, grace_period_s: float) -> list[str]:
    return [sys.executable, "-m", "trainer", *TRAINER_QUIET, "--output-dir", str(output_dir),
            "--checkpoint-dir", checkpoint_dir, "--dataset", "synthetic",
            "--synthetic-shape", f"1,{IMAGE_SIDE},{IMAGE_SIDE}", "--synthetic-classes", str(classes),
            "--synthetic-train-size", "4096", "--synthetic-test-size", "64", "--batch-size", str(BATCH),
            "--epochs", "100", "--log-every", "1", "--grace-period-s", f"{grace_period_s:g}"]


def _train_records(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.is_file():
        return []
    return [record for record in read_metrics(metrics) if record["kind"] == "train"]


def preempt(output_dir: Path, checkpoint_dir: str, classes: int, grace_period_s: float,
            timeout_s: float) -> dict[str, Any]:
    """One trainer run stopped by SIGTERM after its first steps: what the stop took, from its log and its clock."""
    output_dir.mkdir(parents=True, exist_ok=True)
    log_path = output_dir / "trainer.log"
    cmd = _trainer_command(output_dir, checkpoint_dir, classes, grace_period_s)
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, env=clean_env(), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        # Polling a file the trainer writes: the signal must come while it trains, whenever that starts.
        while len(_train_records(output_dir / "metrics.jsonl")) < STEPS_BEFORE_SIGNAL:
            if process.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"the trainer stopped or hung before its step {STEPS_BEFORE_SIGNAL} "
                                 f"(exit {process.returncode}):\n{log_path.read_text()[-1500:]}")
            time.sleep(0.05)
        signalled = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=timeout_s)
        sigterm_to_exit_s = time.perf_counter() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log_path.read_text()
    if returncode != EXIT_PREEMPTED:
        raise BenchError(f"the trainer exited {returncode} after SIGTERM, not {EXIT_PREEMPTED}:\n{text[-1500:]}")
    saves = SAVED.findall(text)
    steps_s = [BATCH / record["samples_per_s"] for record in _train_records(output_dir / "metrics.jsonl")[1:]]
    return {"sigterm_to_exit_s": round(sigterm_to_exit_s, 3),
            "state_mb": float(saves[-1][0]) if saves else None,
            "save_s": float(saves[-1][1]) if saves else None,
            "gave_up": GAVE_UP in text,
            "longest_step_s": round(max(steps_s), 3) if steps_s else None}


def _raw_local(folder: Path, data: bytes) -> float:
    path = folder / "raw.bin"
    started = time.perf_counter()
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    os.fsync(descriptor)
    os.close(descriptor)
    spent = time.perf_counter() - started
    path.unlink()
    return spent


def _raw_upload(location: str, data: bytes) -> float:
    storage: Any = open_storage(location)  # the fsspec backend, as the trainer opens an s3:// folder
    started = time.perf_counter()
    storage.fs.pipe_file(f"{storage.root}/raw.bin", data)
    spent = time.perf_counter() - started
    storage.fs.rm_file(f"{storage.root}/raw.bin")
    return spent


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    sizes_mb, rounds = ctx.pick([50, 200, 800], [2]), ctx.pick(2, 1)
    timeout_s = ctx.pick(600, 120)
    results: list[dict[str, Any]] = []
    with s3_server() as server, environment(server.env):  # the trainer's s3fs and this process's alike
        for size_mb in sizes_mb:
            data = os.urandom(int(size_mb * 1e6))
            for round_index in range(rounds):
                for store in ("local", "s3"):  # interleaved: a slow moment of the machine hits both alike
                    work = ctx.scratch(f"preemption-{size_mb}-{store}-{round_index}")
                    location = str(work / "checkpoints") if store == "local" else f"s3://{server.new_bucket()}/ckpt"
                    measured = preempt(work / "run", location, classes_for(size_mb), 300, timeout_s)
                    raw_s = _raw_local(work, data) if store == "local" else _raw_upload(location, data)
                    results.append({"target_mb": size_mb, "store": store, "round": round_index,
                                    "raw_s": round(raw_s, 3), **measured})
        largest = sizes_mb[-1]
        short_grace_s = ctx.pick(1.0, 0.05)
        cut = preempt(ctx.scratch("preemption-cut") / "run", f"s3://{server.new_bucket()}/ckpt", classes_for(largest),
                      short_grace_s, timeout_s)
    rows = []
    for size_mb in sizes_mb:
        for store, where in (("local", "local disk"), ("s3", "S3-compatible store (moto on loopback)")):
            runs = [r for r in results if r["target_mb"] == size_mb and r["store"] == store]
            ratios = [r["sigterm_to_exit_s"] / r["raw_s"] for r in runs]
            exit_s = statistics.median(r["sigterm_to_exit_s"] for r in runs)
            save_s = statistics.median(r["save_s"] for r in runs if r["save_s"] is not None)
            raw_s = statistics.median(r["raw_s"] for r in runs)
            state_mb = runs[0]["state_mb"] or size_mb
            step_s = max(r["longest_step_s"] or 0.0 for r in runs)
            rows.append(Row(f"SIGTERM to exit 143 / raw write of the same bytes, {state_mb:.0f} MB state, {where}",
                            statistics.median(ratios),
                            notes=f"SIGTERM to exit {exit_s:.2f} s (the save {save_s:.2f} s, "
                                  f"{state_mb / save_s:.0f} MB/s; longest step {step_s:.2f} s), raw {raw_s:.2f} s; "
                                  f"median of {len(runs)}",
                            spread=(min(ratios), max(ratios))))
    over_s = cut["sigterm_to_exit_s"] - short_grace_s
    rows.append(Row(f"a save that does not fit: exit after --grace-period-s {short_grace_s:g} s / that grace period, "
                    f"{largest} MB state to the store", cut["sigterm_to_exit_s"] / short_grace_s,
                    notes=(f"exit 143 {over_s:.2f} s after the grace period, no new checkpoint" if cut["gave_up"] else
                           "the save fitted in the grace period here: nothing was cut")))
    details = {"runs": results, "cut": {"grace_period_s": short_grace_s, **cut},
               "load_average": [load_before, load_average()]}
    return FigureResult(17, "preemption", TITLE, rows, details)
