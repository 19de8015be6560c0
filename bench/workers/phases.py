"""A bare training loop in phases, for two ranks under torchrun: ``python -m bench.workers.phases PLAN OUT``.

Each phase trains its own copy of the tutorial ConvNet for a few steps: rank 0 alone (the one-process
reference, rank 1 waiting), both ranks without communicating (what the hardware allows two processes),
both under bare DDP with one option changed, or with one of the trainer's gradient-sync methods. A
round runs every phase once; rounds repeat. Phases of one round follow each other within seconds, so a
slow spell caused by others' jobs hits them alike, and no process start-up sits between them.

Per phase and round each rank records its wall time, the forward, backward, sync and optimizer parts
of it, its CPU time (the main thread's and the whole process's: the difference is gloo's threads), and
how long its main thread waited for a core. The main thread's wall time is then running + waiting for a
core (other processes had it) + blocked (waiting for the other rank, in gloo).
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.nn.parallel import DistributedDataParallel

from bench.harness.phases import Phase, Plan
from trainer.config import DistConfig
from trainer.distributed import Runtime, StopVote, process_group
from trainer.gradsync import GradSync, build_grad_sync
from trainer.launchers import identity_from_env
from trainer.models import ConvNet
from trainer.syncbn import convert_sync_batchnorm

IMAGE_SHAPE = (1, 28, 28)
CLASSES = 10


class _Trainee:
    """One phase's model, optimizer and (for the trainer's methods) gradient sync, on this rank."""

    def __init__(self, phase: Phase, runtime: Runtime) -> None:
        self.phase = phase
        torch.manual_seed(0)
        model: nn.Module = ConvNet(IMAGE_SHAPE[0], IMAGE_SHAPE[1:], CLASSES)
        if phase.sync_bn:
            model = convert_sync_batchnorm(model, runtime.device)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.sync: GradSync | None = None
        if phase.method == "bare-ddp":
            model = DistributedDataParallel(model, bucket_cap_mb=phase.bucket_mb,
                                            gradient_as_bucket_view=phase.grad_as_bucket_view)
            if phase.hook == "bf16":
                model.register_comm_hook(None, bf16_compress_hook)
        elif phase.method != "none":
            self.sync = build_grad_sync(phase.method, runtime)
            model = self.sync.wrap(model)
        self.model = model
        self.vote = StopVote(runtime) if phase.stop_check else None

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """One optimizer step over len(batches) micro-batches: seconds in forward, backward, sync, optimizer."""
        forward = backward = 0.0
        for index, (images, labels) in enumerate(batches):
            final = index == len(batches) - 1
            with nullcontext() if final else self._no_sync():
                started = time.perf_counter()
                loss = nn.functional.cross_entropy(self.model(images), labels) / len(batches)
                computed = time.perf_counter()
                loss.backward()
                forward += computed - started
                backward += time.perf_counter() - computed
        started = time.perf_counter()
        if self.sync is not None:
            self.sync.after_backward(self.model)
        synced = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        stepped = time.perf_counter()
        if self.vote is not None:
            self.vote(False)
        return [forward, backward, synced - started + time.perf_counter() - stepped, stepped - synced]

    def bucket_bytes(self) -> list[int]:
        """DDP's gradient buckets as rebuilt after the first step (in backward order), [] without DDP."""
        if not isinstance(self.model, DistributedDataParallel):
            return []
        logged = self.model._get_ddp_logging_data()
        sizes = logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes") or ""
        return [int(size) for size in str(sizes).split(",") if size.strip()]

    def _no_sync(self) -> Any:
        if self.sync is not None:
            return self.sync.no_sync(self.model)
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return nullcontext()


def run_plan(plan: Plan, runtime: Runtime) -> list[dict[str, Any]]:
    rank = runtime.identity.rank
    generator = torch.Generator().manual_seed(1000 + rank)
    pool = [(torch.randn(plan.batch_size, *IMAGE_SHAPE, generator=generator),
             torch.randint(0, CLASSES, (plan.batch_size,), generator=generator)) for _ in range(4)]
    batch_sizes = {phase.name: phase.batch_size or plan.batch_size for phase in plan.phases}
    # Every rank builds the two-rank phases in the same order: DDP's constructor is a collective.
    trainees = {phase.name: _Trainee(phase, runtime) for phase in plan.phases if phase.ranks == 2 or rank == 0}
    records = []
    all_cores = os.sched_getaffinity(0)
    for round_index in range(plan.rounds):
        for phase in plan.phases:
            dist.barrier()
            if phase.ranks == 1 and rank != 0:
                continue  # waits in the next barrier; gloo blocks there without spinning a core
            trainee = trainees[phase.name]
            if phase.pin:
                _pin_process({sorted(all_cores)[rank % len(all_cores)]})
            size = batch_sizes[phase.name]
            micro = [(images[:size], labels[:size]) for images, labels in pool[:phase.accum]]
            for _ in range(plan.warmup_steps):
                trainee.step(micro)
            if phase.ranks == 2:
                dist.barrier()
            parts = []
            wall, thread_cpu, process_cpu = time.perf_counter(), time.thread_time(), time.process_time()
            runqueue = _runqueue_wait_s()
            for _ in range(plan.steps):
                parts.append(trainee.step(micro))
            if trainee.vote is not None:
                trainee.vote.settle()  # the last step's vote, as the trainer waits for it where its loop ends
            wall = time.perf_counter() - wall
            thread_cpu, process_cpu = time.thread_time() - thread_cpu, time.process_time() - process_cpu
            runqueue = _runqueue_wait_s() - runqueue
            if phase.pin:
                _pin_process(all_cores)
            records.append({"phase": phase.name, "round": round_index, "rank": rank, "steps": plan.steps,
                            "samples": plan.steps * phase.accum * size, "wall_s": wall,
                            "thread_cpu_s": thread_cpu, "process_cpu_s": process_cpu, "runqueue_s": runqueue,
                            "parts_s": [sum(column) for column in zip(*parts, strict=True)],
                            "bucket_bytes": trainee.bucket_bytes()})
    dist.barrier()
    return records


def _runqueue_wait_s() -> float:
    """Seconds this thread was ready to run but waited for a core (taken by other processes): schedstat's 2nd field."""
    with open("/proc/thread-self/schedstat", encoding="ascii") as schedstat:
        return int(schedstat.read().split()[1]) / 1e9


def _pin_process(cores: set[int]) -> None:
    """Affinity for every thread of this process (gloo's too), not only the calling one."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except (ProcessLookupError, PermissionError):
            continue  # a thread that ended meanwhile


def main(argv: list[str]) -> int:
    plan_path, out_path = (Path(arg) for arg in argv)
    plan = Plan.from_json(plan_path.read_text())
    torch.set_num_threads(1)
    identity = identity_from_env(os.environ)
    if identity.world_size != 2:
        raise SystemExit(f"bench.workers.phases needs 2 ranks (torchrun --nproc-per-node 2), got {identity.world_size}")
    with process_group(DistConfig(), identity, torch.device("cpu")) as runtime:
        records = run_plan(plan, runtime)
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, records)
    if identity.is_main:
        out_path.write_text(json.dumps([record for rank_records in gathered for record in rank_records]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
