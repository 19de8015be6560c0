"""Figure 12: sharded checkpoints (torch.distributed.checkpoint underneath, format 5) at 2 ranks, on a stack of
Linear layers with AdamW (full: 24 x 2048 x 2048, 403 MB of parameters and 1.2 GB of parameters and AdamW state;
quick: 2 x 128 x 128), through the trainer's CheckpointManager and state parts (bench.workers.sharded_checkpoints):

  save      a synchronous sharded save, the slowest rank, against each rank writing the same tensors with one
            torch.save (what format 4 did): what the manifest, the checksums and DCP's planning cost;
  resume    its restore at the same world size, the slowest rank, against one torch.load of that raw file, in 3
            rounds, alternately first (the median);
  memory    each rank's peak memory growth (RssAnon) during a restore, against its share (the bytes of its
            parameters and AdamW state): resuming fsdp at 2 ranks, converting a DDP checkpoint to fsdp, resharding
            2 -> 3 ranks; and a sharded checkpoint restored under ddp against the whole state, which ddp holds;
  read      bytes of checkpoint each rank reads on a reshard 2 -> 3 (and 8 -> 5 on small tensors), against its
            share: of each saved chunk holding rows it needs, a rank reads the 1 MiB blocks that hold them
            (trainer.checkpoint.dcp_items), so beyond its share it reads at most a block on each side of its rows
            in each chunk; a chunk smaller than a block is read whole (the 8 -> 5 case).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.figures.sharded import FIXED_MMAP_THRESHOLD
from bench.harness.context import Context
from bench.harness.measure import load_average, paired_ratio
from bench.harness.results import FigureResult, Goal, Row
from devtools.processes import torchrun

TITLE = "Sharded checkpoints (DCP inside): save, resume, memory and bytes read at 2 ranks"
SMALL = (256, 4)  # width and blocks of the 8-rank runs


def _phase(ctx: Context, phase: str, sync: str, ranks: int, folder: str, width: int, blocks: int) -> list[dict]:
    result = torchrun([phase, sync, str(width), str(blocks), folder], nproc=ranks,
                      module="bench.workers.sharded_checkpoints", timeout_s=900,
                      env={**FIXED_MMAP_THRESHOLD, "BENCH_ROUNDS": str(ctx.pick(3, 1))})
    if result.returncode != 0:
        raise RuntimeError(f"bench.workers.sharded_checkpoints {phase} {sync} x{ranks} failed: "
                           f"{result.stderr[-2000:]}")
    return [json.loads((Path(folder) / "records" / f"{phase}-{sync}-{ranks}-rank{rank}.json").read_text())
            for rank in range(ranks)]


def _size(count: float) -> str:
    return f"{count / 1e6:.0f} MB" if count >= 1e7 else f"{count / 1e3:.0f} kB"


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    width, blocks = ctx.pick((2048, 24), (128, 2))
    sharded, plain = str(ctx.scratch("sharded-checkpoints-fsdp")), str(ctx.scratch("sharded-checkpoints-ddp"))
    many = str(ctx.scratch("sharded-checkpoints-many"))
    # Full: 8 ranks resharded to 5. Quick (CI's smoke run, the same code paths): 4 to 3, since 13 processes that each
    # import torch took most of this figure's 133 s on a 2-core CI machine.
    saved_by, resumed_by = ctx.pick((8, 5), (4, 3))
    reshard = f"reshard {saved_by} to {resumed_by}"
    measured = {
        "save fsdp": _phase(ctx, "save", "fsdp", 2, sharded, width, blocks),
        "save ddp": _phase(ctx, "save", "ddp", 2, plain, width, blocks),
        "resume fsdp": _phase(ctx, "resume", "fsdp", 2, sharded, width, blocks),
        "ddp to fsdp": _phase(ctx, "resume", "fsdp", 2, plain, width, blocks),
        "fsdp to ddp": _phase(ctx, "resume", "ddp", 2, sharded, width, blocks),
        "reshard 2 to 3": _phase(ctx, "resume", "fsdp", 3, sharded, width, blocks),
        # The counts at many ranks (8, or 4 in quick mode), on small tensors: that many processes on these cores.
        f"save fsdp x{saved_by}": _phase(ctx, "save", "fsdp", saved_by, many, SMALL[0], SMALL[1]),
        reshard: _phase(ctx, "resume", "fsdp", resumed_by, many, SMALL[0], SMALL[1]),
    }
    save, rounds = measured["save fsdp"][0], measured["resume fsdp"][0]["rounds"]
    resume_ratio = paired_ratio([r["restore"] for r in rounds], [r["raw"] for r in rounds])

    def worst(name: str, key: str, over: str) -> tuple[float, str]:
        ratios = [(record[key] / record[over], record) for record in measured[name]]
        ratio, record = max(ratios, key=lambda pair: pair[0])
        return ratio, f"rank {record['rank']}: {_size(record[key])} against {_size(record[over])}"

    rows = [Row("sharded save (format 5) / one torch.save per rank of the same tensors",
                save["save_s"] / save["raw_save_s"], Goal("<=", 1.5),
                notes=f"{save['save_s']:.2f} s against {save['raw_save_s']:.2f} s, slowest rank"),
            Row("sharded resume, same world size / one torch.load of that file", resume_ratio.median,
                Goal("<=", 2.0), spread=resume_ratio.spread,
                notes=f"{statistics.median(r['restore'] for r in rounds):.2f} s against "
                      f"{statistics.median(r['raw'] for r in rounds):.2f} s (medians of {len(rounds)} rounds, "
                      f"slowest rank); the manifest, the metadata and every range's checksum included")]
    for name, label in (("resume fsdp", "resume at 2 ranks"), ("ddp to fsdp", "a DDP checkpoint resumed under fsdp"),
                        ("reshard 2 to 3", "resharded 2 -> 3 ranks"), ("fsdp to ddp", "a sharded one under ddp")):
        ratio, notes = worst(name, "grown", "share")
        over = "its share" if name != "fsdp to ddp" else "the whole state (ddp's share)"
        rows.append(Row(f"peak memory growth while restoring / {over}: {label}", ratio, Goal("<=", 1.25),
                        notes=f"worst {notes}"))

    ratio, notes = worst("reshard 2 to 3", "bytes_read", "share")
    rows.append(Row("bytes read per rank on a reshard 2 -> 3 / its share", ratio, Goal("<=", 1.25),
                    notes=f"worst {notes}; the blocks holding its rows are read (before 2026-11-26, whole saved "
                          f"chunks: 3.0)"))
    ratio, notes = worst(reshard, "bytes_read", "share")
    rows.append(Row(f"bytes read per rank on a reshard {saved_by} -> {resumed_by} (4 x 256 x 256) / its share", ratio,
                    notes=f"worst {notes}; each saved chunk is smaller than a block (1 MiB) and read whole; reported, "
                          f"no goal"))
    ratio, notes = worst("resume fsdp", "bytes_read", "share")
    rows.append(Row("bytes read per rank on a resume at 2 ranks / its share", ratio, Goal("<=", 1.05),
                    notes=f"worst {notes}"))
    details = {"runs": measured, "model": {"width": width, "blocks": blocks},
               "load_average": [load_before, load_average()]}
    return FigureResult(12, "sharded-checkpoints", TITLE, rows, details)
