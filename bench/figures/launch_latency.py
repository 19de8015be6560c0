"""Figure 8: launch latency: from the launch command to the trainer's first training step, per launcher.

Each launcher starts 2 ranks of the trainer on synthetic data (the container image lacks the Debian
dataset, so only generated data is the same everywhere), and the first step's time is the trainer's
first metrics record with ``--log-every 1``. The reference, in the same round, is the floor of any
torchrun job: ``bench.workers.hello`` joins the group and completes one all-reduce. TorchX runs with its
``local_cwd`` scheduler from the repository root; Compose runs the repository's compose.yaml as two
one-rank nodes (c10d rendezvous across containers), its command extended by the same trainer flags.
A launcher that this machine lacks is reported as not measured, with the reason.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from itertools import count
from pathlib import Path

import yaml

from bench.harness.context import Context
from bench.harness.launch import TRAINER_QUIET, first_step_time, read_metrics, run_trainer
from bench.harness.launch import run as run_command
from bench.harness.measure import interleave, load_average, median, paired_ratio
from bench.harness.results import FigureResult, Row
from devtools.processes import BIN_DIR, REPO_ROOT, clean_env, torchrun_command

TITLE = "Launch latency (2 ranks, to the first step)"
TRAINER_ARGS = ("--dataset", "synthetic", "--synthetic-train-size", "1024", "--synthetic-test-size", "256",
                "--epochs", "1", "--max-steps", "1", "--log-every", "1", "--batch-size", "128")
COMPOSE_PROJECT = "ddp-bench-latency"
COMPOSE_IMAGE = "ddp-deploy:latest"
TIMEOUT_S = 300


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    runs = count()
    cases: dict[str, Callable[[], float]] = {
        "hello": lambda: _hello(ctx.scratch(f"latency-{next(runs)}")),
        "torchrun": lambda: _torchrun(ctx.scratch(f"latency-{next(runs)}")),
    }
    unavailable = {}
    for name, check, launcher in (("torchx", _torchx_missing, _torchx), ("compose", _compose_missing, _compose)):
        reason = "quick mode runs torchrun only" if ctx.quick else check()
        if reason:
            unavailable[name] = reason
        else:
            cases[name] = lambda launcher=launcher: launcher(ctx.scratch(f"latency-{next(runs)}"))
    seconds = interleave(cases, rounds=ctx.pick(2, 1))
    labels = {"torchrun": "torchrun", "torchx": "TorchX `local_cwd`", "compose": "Docker Compose (2 containers)"}
    rows = []
    for name, label in labels.items():
        if name in unavailable:
            rows.append(Row(f"{label} / bare torchrun hello", None, notes=f"not measured ({unavailable[name]})"))
            continue
        ratio = paired_ratio(seconds[name], seconds["hello"])
        rows.append(Row(f"{label} / bare torchrun hello", ratio.median, spread=ratio.spread,
                        notes=f"first step after {median(seconds[name]):.1f} s; hello's all-reduce after "
                              f"{median(seconds['hello']):.1f} s"))
    details = {"seconds": seconds, "not_measured": unavailable, "trainer_args": list(TRAINER_ARGS),
               "load_average": [load_before, load_average()]}
    return FigureResult(8, "launch", TITLE, rows, details)


def _hello(work: Path) -> float:
    done = work / "hello.txt"
    launched = time.time()
    run_command(torchrun_command(2, "bench.workers.hello", [str(done)]), TIMEOUT_S)
    return float(done.read_text()) - launched


def _torchrun(work: Path) -> float:
    trainer = run_trainer(TRAINER_ARGS, work / "out", nproc=2, timeout_s=TIMEOUT_S)
    return first_step_time(trainer.records) - trainer.launched_at


def _torchx_missing() -> str:
    if not (BIN_DIR / "torchx").exists():
        return "torchx is not installed in this environment: pip install -e '.[torchx]'"
    return ""


def _torchx(work: Path) -> float:
    env = {"TORCHXCONFIG": str(REPO_ROOT / ".torchxconfig")}
    cmd = [str(BIN_DIR / "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={work / 'logs'}",
           "torchx_components/train.py:ddp", "-j", "1x2", "--output_dir", str(work / "out"), "--",
           *TRAINER_QUIET, *TRAINER_ARGS]
    launched = time.time()
    run_command(cmd, TIMEOUT_S, env=env)
    return first_step_time(read_metrics(work / "out" / "metrics.jsonl")) - launched


def _compose_missing() -> str:
    if shutil.which("docker") is None:
        return "no docker command on this machine"
    probes = (["docker", "info"], ["docker", "compose", "version"], ["docker", "image", "inspect", COMPOSE_IMAGE])
    reasons = ("the Docker engine does not answer", "Docker Compose v2 is missing",
               f"image {COMPOSE_IMAGE} not built: docker build -f docker/Dockerfile -t ddp-deploy .")
    for probe, reason in zip(probes, reasons, strict=True):
        if subprocess.run(probe, capture_output=True, check=False, timeout=60).returncode != 0:
            return reason
    return ""


def _compose(work: Path) -> float:
    """compose.yaml as it is, plus an override: the trainer's flags appended, runs/ bound to a folder here."""
    runs_dir = work / "runs"
    runs_dir.mkdir()
    runs_dir.chmod(0o777)  # the image runs as uid 1000
    base = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())
    # The compose file's command is one string that Compose splits into words: the flags go at its end.
    command = " ".join([base["services"]["node"]["command"], *TRAINER_QUIET, *TRAINER_ARGS])
    override = work / "compose.bench.yaml"
    override.write_text(yaml.safe_dump({"services": {"node": {"command": command,
                                                              "volumes": [f"{runs_dir}:/workspace/runs"]}}}))
    env = {"COMPOSE_PROJECT_NAME": COMPOSE_PROJECT, "NODES": "2", "RANKS_PER_NODE": "1", "DATASET": "synthetic",
           "EPOCHS": "1", "RUN_NAME": "latency", "IMAGE": COMPOSE_IMAGE}
    compose = ["docker", "compose", "-p", COMPOSE_PROJECT, "-f", str(REPO_ROOT / "compose.yaml"), "-f", str(override)]
    try:
        launched = time.time()
        run_command([*compose, "up", "--no-build", "--pull", "never"], TIMEOUT_S, env=env)
        return first_step_time(read_metrics(runs_dir / "latency" / "metrics.jsonl")) - launched
    finally:
        subprocess.run([*compose, "down", "--volumes", "--remove-orphans"], env=clean_env(env), capture_output=True,
                       check=False, timeout=120)
