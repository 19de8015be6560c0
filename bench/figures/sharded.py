"""Figure 11: --sync fsdp against --sync ddp at 2 ranks on the same model: memory, speed, checkpoint saves.

Each round runs bench.workers.sharded once per method, alternately, on a stack of Linear layers trained with
AdamW (full: 16 x 2048 x 2048, 268 MB of parameters and 1.07 GB of parameters, gradients and AdamW's two
moments per DDP rank; quick: 2 x 256 x 256). Ratios are taken round by round, then the median:
  held      bytes of parameters + gradients + optimizer state that one rank's tensors hold (goal: 1/N + 0.05);
  resident  the growth of one rank's peak anonymous resident memory (RssAnon, sampled every millisecond) from
            before the model is built (same goal): what the process really needed, the gathered units and the
            communication buffers included, the libraries' code pages not.
            Both methods run with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_): its default raises the
            threshold after each freed buffer and then keeps freed buffers resident, which counts every
            all-gather's and reduce-scatter's temporary as if it were still held;
  speed     samples/s of FSDP / DDP (reported: on gloo, FSDP's reduce-scatter is an all-reduce followed by a
            slice, twice DDP's traffic for the gradients, and it all-gathers the parameters in forward and again
            in backward: three model-sized collectives a step against DDP's one);
  save      a synchronous CheckpointManager.save, the slowest rank's time: every rank writes its own rows in
            parallel against rank 0 writing the whole state (goal <= 0.6).
"""

from __future__ import annotations

import json
import statistics

from bench.harness.context import Context
from bench.harness.measure import load_average, paired_ratio
from bench.harness.results import FigureResult, Goal, Row
from devtools.processes import torchrun

TITLE = "Sharded data parallel: FSDP / DDP at 2 ranks (memory, speed, checkpoint save)"
RANKS = 2
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    width, blocks, steps = ctx.pick((2048, 16, 5), (256, 2, 2))
    rounds = ctx.pick(3, 1)
    measured: dict[str, list[dict]] = {"ddp": [], "fsdp": []}
    for round_index in range(rounds):
        for method in ("ddp", "fsdp") if round_index % 2 == 0 else ("fsdp", "ddp"):
            folder = ctx.scratch(f"sharded-{method}-{round_index}")
            result = torchrun([method, str(width), str(blocks), str(steps), str(folder)], nproc=RANKS,
                              module="bench.workers.sharded", env=FIXED_MMAP_THRESHOLD, timeout_s=600)
            if result.returncode != 0:
                raise RuntimeError(f"bench.workers.sharded {method} failed: {result.stderr[-2000:]}")
            measured[method].append(json.loads(result.stdout.strip().splitlines()[-1]))
    ddp, fsdp = measured["ddp"], measured["fsdp"]
    goal = Goal("<=", 1 / RANKS + 0.05)
    held = paired_ratio([sum(r["held"].values()) for r in fsdp], [sum(r["held"].values()) for r in ddp])
    resident = paired_ratio([r["grown"] for r in fsdp], [r["grown"] for r in ddp])
    speed = paired_ratio([r["samples_per_s"] for r in fsdp], [r["samples_per_s"] for r in ddp])
    save = paired_ratio([r["save_s"] for r in fsdp], [r["save_s"] for r in ddp])
    mb = 1e6
    rows = [
        Row("tensors held per rank (parameters + gradients + AdamW state), FSDP / DDP", held.median, goal,
            notes=f"DDP {sum(ddp[0]['held'].values()) / mb:.0f} MB, FSDP {sum(fsdp[0]['held'].values()) / mb:.0f} MB "
                  f"a rank ({ddp[0]['full_parameter_bytes'] / mb:.0f} MB of parameters)", spread=held.spread),
        Row("peak memory growth per rank (RssAnon), FSDP / DDP", resident.median, goal,
            notes=f"DDP {statistics.median(r['grown'] for r in ddp) / mb:.0f} MB, FSDP "
                  f"{statistics.median(r['grown'] for r in fsdp) / mb:.0f} MB (model built on the meta device; "
                  f"gathered units and communication buffers included)", spread=resident.spread),
        Row("samples/s, FSDP / DDP (gloo)", speed.median,
            notes="reported, no goal: gloo emulates reduce-scatter with an all-reduce, and FSDP gathers the "
                  "parameters twice a step; on NCCL these are native", spread=speed.spread),
        Row("synchronous checkpoint save, FSDP (each rank its rows) / DDP (rank 0 all)", save.median,
            Goal("<=", 0.6), notes=f"DDP {statistics.median(r['save_s'] for r in ddp):.2f} s, FSDP "
                                    f"{statistics.median(r['save_s'] for r in fsdp):.2f} s", spread=save.spread),
    ]
    details = {"runs": measured, "model": {"width": width, "blocks": blocks, "steps": steps, "rounds": rounds},
               "load_average": [load_before, load_average()]}
    return FigureResult(11, "sharded", TITLE, rows, details)
