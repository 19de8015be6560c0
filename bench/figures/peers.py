"""Figure 10: the trainer against Hugging Face Accelerate and Lightning Fabric doing the same work.

Two ranks under torchrun on this machine (gloo, one thread each), the ConvNet on Fashion-MNIST in memory,
batch 128 per rank, fused AdamW; each reduces its loss and accuracy across ranks every LOG_EVERY steps
(bench/workers/peer_loop.py for the peers, metrics windows for the trainer). A run's value is the median
samples/s of its windows after the first; the three run one after the other, round after round, and each
ratio is taken within a round.
"""

from __future__ import annotations

import sys
from itertools import count

from bench.harness.context import Context
from bench.harness.launch import fashion_mnist_convnet_args, run_trainer, steady_windows
from bench.harness.measure import interleave, load_average, median, paired_ratio
from bench.harness.results import FigureResult, Goal, Row
from devtools.processes import torchrun_command

TITLE = "Against the peers (2 ranks)"
GOAL = Goal(">=", 1.0)
PEERS = {"accelerate": "Hugging Face Accelerate", "fabric": "Lightning Fabric"}


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    steps, log_every = ctx.pick(120, 8), ctx.pick(10, 4)
    trainer_args = fashion_mnist_convnet_args(steps, log_every)
    runs = count()

    def trainer() -> float:
        output = ctx.scratch(f"peers-trainer-{next(runs)}")
        return run_trainer(trainer_args, output, 2, ctx.pick(300, 180)).steady_samples_per_s()

    def peer(name: str) -> float:
        out = ctx.scratch("peers") / f"{name}-{next(runs)}.json"
        command = torchrun_command(2, "bench.workers.peer_loop", [name, str(steps), str(log_every), str(out)])
        return steady_windows(command, out, ctx.pick(300, 180))

    # Seven rounds, interleaved: a slow spell of a shared machine hits all three alike.
    values = interleave({"trainer": trainer, **{name: lambda name=name: peer(name) for name in PEERS}},
                        rounds=ctx.pick(7, 1))
    rows = []
    for name, label in PEERS.items():
        ratio = paired_ratio(values["trainer"], values[name])
        rows.append(Row(f"trainer samples/s / {label} samples/s", ratio.median, GOAL, spread=ratio.spread,
                        notes=f"median of {len(ratio.rounds)} round(s); {steps} steps, windows of {log_every}, the "
                              f"first left out; trainer {median(values['trainer']):,.0f}, {name} "
                              f"{median(values[name]):,.0f} samples/s (medians)"))
    details = {"samples_per_s": values, "steps": steps, "log_every": log_every, "python": sys.version.split()[0],
               "load_average": [load_before, load_average()]}
    return FigureResult(10, "peers", TITLE, rows, details)
