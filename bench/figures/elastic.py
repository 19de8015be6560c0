"""Figure 13: the cost of a membership change inside one running torchrun job (docs/elastic.md).

Two elastic agents on this machine (``--nnodes=1:2``, one rank each, the c10d rendezvous of devtools/elastic.py:
``last_call_timeout=1``, keep-alives 1 s apart) train the built-in task on synthetic data with a checkpoint every
5 steps and a metrics record every step. One agent is lost (its process tree killed): the time from the kill to
the first step completed after it, split into detection (the survivor's worker fails: the agent's log),
rendezvous (the agent's "Rendezvous complete"), and the restart up to the first step (process start, checkpoint
load, the step: metrics.jsonl); and the steps lost (trained before the kill, after the checkpoint resumed). Then
an agent joins: the time from its start to the first step at two ranks, and the steps lost (none: the running
workers stop at their step and save). Then that agent leaves gracefully (SIGTERM, as a scale-down or a drained
node sends it): every rank stops at the same step and saves, and the survivor goes on alone. The reference, in
the same round: a cold start of the same job, one torchrun at one rank resuming the same checkpoint, from its
launch to its first step.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

from bench.harness.context import Context
from bench.harness.launch import BenchError, read_metrics, run_trainer
from bench.harness.measure import load_average, median
from bench.harness.results import FigureResult, Goal, Row
from devtools.elastic import Agent, ElasticJob

TITLE = "Elastic membership change (2 agents of 1 rank, loopback): recovery and lost work"
ARGS = ("--dataset", "synthetic", "--synthetic-train-size", "4096", "--synthetic-test-size", "64", "--batch-size",
        "32", "--epochs", "1000", "--log-every", "1", "--checkpoint-every", "5", "--threads-per-rank", "1",
        "--progress", "off", "--no-tensorboard")
RECOVERY_GOAL = Goal("<=", 2.0)
TIMEOUT_S = 180
# The parts of a recovery, in order: the agent's log, then rank 0's "resume" record (trainer.api.ResumeTiming).
PARTS = {"detection_s": "detection", "rendezvous_s": "rendezvous", "start_s": "process start",
         "build_s": "model and data", "load_s": "checkpoint load", "first_step_s": "first step"}
RESUMED = re.compile(r"\[rank 0/(\d+)\] INFO resumed from (\S+step-(\d+)):")


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    rounds = [_round(ctx.scratch(f"elastic-{index}")) for index in range(ctx.pick(3, 1))]
    loss = [r["loss"] for r in rounds]
    join = [r["join"] for r in rounds]
    leave = [r["leave"] for r in rounds]
    cold = [r["cold_start_s"] for r in rounds]

    def over_cold(cases: list[dict[str, Any]]) -> list[float]:
        return [case["total_s"] / c for case, c in zip(cases, cold, strict=True)]

    total = [case["total_s"] for case in loss]

    def split(cases: list[dict[str, Any]]) -> str:
        parts = {name: median([case[name] for case in cases]) for name in PARTS}
        return ", ".join(f"{label} {parts[name]:.1f} s" for name, label in PARTS.items())

    rows = [
        Row("node lost: kill to the first step after it / a cold start (launch to first step)",
            median(over_cold(loss)), RECOVERY_GOAL, spread=(min(over_cold(loss)), max(over_cold(loss))),
            notes=f"{median(total):.1f} s: {split(loss)}; cold start {median(cold):.1f} s; median of "
                  f"{len(rounds)} round(s)"),
        Row("node lost: steps lost (trained, not in the checkpoint resumed), --checkpoint-every 5",
            median([case["lost_steps"] for case in loss]), notes=f"per round: {[c['lost_steps'] for c in loss]}"),
        Row("node joined: its start to the first step at 2 ranks / a cold start",
            median(over_cold(join)), RECOVERY_GOAL,
            notes=f"{median([case['total_s'] for case in join]):.1f} s: {split(join)} (detection: the running "
                  f"workers stop at their step and save)"),
        Row("node joined: steps lost", median([case["lost_steps"] for case in join]), Goal("<=", 0.0),
            notes=f"per round: {[c['lost_steps'] for c in join]}"),
        Row("node left gracefully (its agent got SIGTERM): to the first step after it / a cold start",
            median(over_cold(leave)), RECOVERY_GOAL,
            notes=f"{median([case['total_s'] for case in leave]):.1f} s: {split(leave)} (detection: every rank "
                  f"stops at one step and saves)"),
        Row("node left gracefully: steps lost", median([case["lost_steps"] for case in leave]), Goal("<=", 0.0),
            notes=f"per round: {[c['lost_steps'] for c in leave]}"),
    ]
    details: dict[str, Any] = {"rounds": rounds, "trainer_args": list(ARGS), "load_average": [load_before,
                                                                                                load_average()]}
    return FigureResult(13, "elastic", TITLE, rows, details)


def _round(work: Path) -> dict[str, Any]:
    out = work / "run"
    job = ElasticJob(work, [*ARGS, "--output-dir", str(out)], run_id=f"bench-{work.name}",
                     env={"LOGLEVEL": "INFO"})  # INFO: the agents log each rendezvous
    try:
        first = job.start("first")  # serves the rendezvous: it stays
        time.sleep(1)
        lost = job.start("lost")
        job.wait_for(lambda: _last_step(out) >= 12, "two ranks to train 12 steps", TIMEOUT_S)
        killed = time.time()
        lost.lose()
        loss = _recovery(first, job, out, since=killed, world=1, event="failed \\(exitcode")
        joined_at = time.time()
        joined = job.start("joined")
        join = _recovery(first, job, out, since=joined_at, world=2, event="closing signal SIGTERM")
        left_at = time.time()
        joined.process.send_signal(signal.SIGTERM)  # a graceful scale-down: its agent stops its worker
        leave = _recovery(first, job, out, since=left_at, world=1, event="failed \\(exitcode")
    finally:
        job.stop()
    checkpoint = sorted((out / "checkpoints").glob("step-*"))[-1]
    step = int(checkpoint.name.split("-")[1])
    cold = run_trainer([*ARGS, "--resume", str(checkpoint), "--max-steps", str(step + 1)], work / "cold", nproc=1,
                       timeout_s=TIMEOUT_S, quiet=())
    first_after = next(record["time"] for record in cold.records if record["kind"] == "train")
    return {"loss": loss, "join": join, "leave": leave, "cold_start_s": first_after - cold.launched_at}


def _recovery(agent: Agent, job: ElasticJob, out: Path, since: float, world: int, event: str) -> dict[str, Any]:
    """From ``since`` (the kill, or the new agent's start) to the first step of the workers restarted at
    ``world`` ranks: the agent's ``event`` (the worker's failure, or its stop), the next rendezvous, the step."""
    before = max((record["step"] for record in _train(out) if record["time"] < since), default=0)
    known = len(_resumes(job, world))
    job.wait_for(lambda: len(_resumes(job, world)) > known, f"the workers to resume at {world} rank(s)",
                 TIMEOUT_S)
    job.wait_for(lambda: any(record["time"] > _complete(agent, since) for record in _train(out)),
                 "a step after it", TIMEOUT_S)
    stopped = min(t for t in agent.events(event) if t > since - 1)
    rendezvous = _complete(agent, since)
    records = _train(out)
    first_step = min(record["time"] for record in records if record["time"] > rendezvous)
    resumed_step = _resumes(job, world)[-1]
    trained = max((record["step"] for record in records if record["time"] < rendezvous), default=before)
    if max(before, trained) < resumed_step:
        raise BenchError(f"resumed from step {resumed_step}, beyond the last step trained ({max(before, trained)}): "
                         f"the logs were misread")
    # Rank 0's "resume" record (trainer.api.ResumeTiming), written once the checkpoint is restored.
    resume = min((record for record in _records(out, "resume") if rendezvous < record["time"] < first_step),
                 key=lambda record: record["time"], default=None)
    if resume is None:
        raise BenchError(f"no resume record between the rendezvous and the first step in {out / 'metrics.jsonl'}")
    loading = resume["read_s"] + resume["build_s"] + resume["restore_s"]
    return {"total_s": first_step - since, "detection_s": stopped - since, "rendezvous_s": rendezvous - stopped,
            "restart_s": first_step - rendezvous, "start_s": resume["time"] - loading - rendezvous,
            "load_s": resume["read_s"] + resume["restore_s"], "build_s": resume["build_s"],
            "first_step_s": first_step - resume["time"], "lost_steps": max(before, trained) - resumed_step}


def _complete(agent: Agent, since: float) -> float:
    later = [t for t in agent.events("Rendezvous complete") if t > since]
    return min(later) if later else float("inf")


def _resumes(job: ElasticJob, world: int) -> list[int]:
    return [int(m.group(3)) for agent in job.agents for m in RESUMED.finditer(agent.text())
            if int(m.group(1)) == world]


def _train(out: Path) -> list[dict[str, Any]]:
    return _records(out, "train")


def _records(out: Path, kind: str) -> list[dict[str, Any]]:
    try:
        return [record for record in read_metrics(out / "metrics.jsonl") if record["kind"] == kind]
    except (BenchError, ValueError):  # not written yet, or a line being written
        return []


def _last_step(out: Path) -> int:
    return max((record["step"] for record in _train(out)), default=0)
