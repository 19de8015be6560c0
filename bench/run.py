"""The benchmark suite: ``python -m bench.run [--quick] [--only NAME ...]`` (``make bench``, ``make bench-quick``).

A full run writes results.json, results.md and the PNG plots to bench/results/ (what the README shows);
``--quick`` (CI's smoke run: every code path, tiny sizes, numbers not representative) writes them to
bench/results/raw/quick/, which git ignores. With ``--only``, the named figures replace theirs in the
results already there and the others are kept. Exit status 1 when a figure failed to run; timings
never fail the run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from bench.figures import (
    checkpointing,
    elastic,
    image_folder,
    input_pipeline,
    launch_latency,
    object_store,
    overhead,
    peers,
    preemption,
    ray_overhead,
    scaling,
    sharded,
    sharded_checkpoints,
    slow_rank,
    streamed_shards,
    sync_bn,
    sync_methods,
    time_to_accuracy,
)
from bench.harness.context import Context
from bench.harness.measure import describe_machine, load_average
from bench.harness.plots import make_plots
from bench.harness.results import FigureResult, markdown_table, read_json, write_json, write_markdown
from devtools.s3_server import ServerDied
from trainer.errors import described

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUICK_DIR = RESULTS_DIR / "raw" / "quick"
# In figure order; the key is the --only name.
FIGURES: dict[str, tuple[str, Callable[[Context], FigureResult]]] = {
    "scaling": (scaling.TITLE, scaling.run),
    "sync": (sync_methods.TITLE, sync_methods.run),
    "overhead": (overhead.TITLE, overhead.run),
    "input": (input_pipeline.TITLE, input_pipeline.run),
    "accuracy": (time_to_accuracy.TITLE, time_to_accuracy.run),
    "syncbn": (sync_bn.TITLE, sync_bn.run),
    "checkpoint": (checkpointing.TITLE, checkpointing.run),
    "launch": (launch_latency.TITLE, launch_latency.run),
    "imagefolder": (image_folder.TITLE, image_folder.run),
    "peers": (peers.TITLE, peers.run),
    "sharded": (sharded.TITLE, sharded.run),
    "sharded-checkpoints": (sharded_checkpoints.TITLE, sharded_checkpoints.run),
    "elastic": (elastic.TITLE, elastic.run),
    "object-store": (object_store.TITLE, object_store.run),
    "ray": (ray_overhead.TITLE, ray_overhead.run),
    "shards": (streamed_shards.TITLE, streamed_shards.run),
    "preemption": (preemption.TITLE, preemption.run),
    "slow-rank": (slow_rank.TITLE, slow_rank.run),
}


@dataclass(frozen=True)
class Suite:
    """A set of figures run and written together: this module's CPU suite, bench.gpu's GPU suite."""

    module: str  # what ``python -m`` runs
    description: str
    figures: dict[str, tuple[str, Callable[[Context], FigureResult]]]  # in figure order; the key is --only's
    results_dir: Path
    quick_dir: Path
    quick_help: str
    full_run_needs_cuda: bool = False  # the GPU suite: only --quick runs without a CUDA device


CPU_SUITE = Suite("bench.run", __doc__.split("\n\n")[0], FIGURES, RESULTS_DIR, QUICK_DIR,
                  "CI smoke mode: tiny sizes, about 2-3 minutes")


def main(argv: Sequence[str] | None = None) -> int:
    return run_suite(CPU_SUITE, argv)


def run_suite(suite: Suite, argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {suite.module}", description=suite.description)
    parser.add_argument("--quick", action="store_true", help=suite.quick_help)
    parser.add_argument("--only", action="append", choices=list(suite.figures), metavar="NAME",
                        help=f"run only this figure (repeatable): {', '.join(suite.figures)}")
    parser.add_argument("--output-dir", type=Path, help=f"where results go (default: {_shown(suite.results_dir)}, "
                                                        f"{_shown(suite.quick_dir)} with --quick)")
    args = parser.parse_args(argv)
    if suite.full_run_needs_cuda and not args.quick and not torch.cuda.is_available():
        print(f"python -m {suite.module}: no CUDA device here; the full GPU figures need one (--quick runs every "
              f"figure tiny on the CPU)", file=sys.stderr)
        return 2
    out_dir: Path = args.output_dir or (suite.quick_dir if args.quick else suite.results_dir)
    selected = args.only or list(suite.figures)

    header: dict[str, Any] = {"quick": args.quick, "started": datetime.now(UTC).isoformat(timespec="seconds"),
                              "command": f"python -m {suite.module} " + " ".join(sys.argv[1:] if argv is None
                                                                                 else argv),
                              "machine": describe_machine()}
    figures = _kept_figures(out_dir / "results.json", args.quick, selected)
    started, load_start = time.perf_counter(), load_average()
    failed = False
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as work:
        ctx = Context(args.quick, Path(work))
        for key in selected:
            number = list(suite.figures).index(key) + 1
            title, measure = suite.figures[key]
            print(f"[bench] figure {number}: {title} ...", flush=True)
            figure_started = time.perf_counter()
            retried_after = None
            try:
                try:
                    result = measure(ctx)
                except ServerDied as died:
                    # A loopback server the figure relies on stopped under it: the machine's fault, not the
                    # figure's. Measured once more from the start, and the first failure kept in the results.
                    traceback.print_exc()
                    retried_after = described(died)[:300]
                    print(f"[bench] figure {number}: its server died; measuring it once more", flush=True)
                    result = measure(ctx)
            except Exception as error:  # one figure's failure must not lose the others' results
                traceback.print_exc()
                result = FigureResult.failed(number, key, title, described(error)[:300])
                failed = True
            if retried_after is not None:
                result.details["retried_after"] = retried_after
            result.details["duration_s"] = round(time.perf_counter() - figure_started, 1)
            print(f"[bench] figure {number} done in {result.details['duration_s']:.0f} s", flush=True)
            figures[key] = result
            header.update(duration_s=time.perf_counter() - started, load_average=f"{load_start} at the start, "
                                                                                  f"{load_average()} at the end")
            save(out_dir, header, list(figures.values()))
    print(markdown_table(list(figures.values())))
    print(f"[bench] results in {out_dir}", flush=True)
    return 1 if failed else 0


def save(out_dir: Path, header: dict[str, Any], figures: list[FigureResult]) -> None:
    """results.json, the plots, then results.md that shows them."""
    write_json(out_dir / "results.json", header, figures)
    plots = make_plots(figures, out_dir)
    write_markdown(out_dir / "results.md", header, figures, plots)


def _shown(path: Path) -> str:
    """A results folder as --help shows it: relative to the repository when inside it."""
    root = RESULTS_DIR.parent.parent
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _kept_figures(path: Path, quick: bool, selected: list[str]) -> dict[str, FigureResult]:
    """The figures of an earlier run of the same mode that this run does not redo."""
    if not path.is_file():
        return {}
    header, figures = read_json(path)
    if header.get("quick") != quick:
        return {}
    return {figure.key: figure for figure in figures if figure.key not in selected}


if __name__ == "__main__":
    sys.exit(main())
