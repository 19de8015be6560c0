"""Figure 7: checkpointing, measured by bench.checkpoint_bench (written with the checkpoint code).

checkpoint_bench.run(quick) returns a dict. Each entry whose value is a number becomes a row named
by its key; an entry that is a dict with a "ratio" becomes a row with its "measure" and "notes" if
given. Everything it returned is kept in the details.
"""

from __future__ import annotations

import importlib
from typing import Any

from bench.context import Context
from bench.measure import load_average
from bench.results import FigureResult, Row

TITLE = "Checkpointing"
EXPECTED = ("save throughput / raw write+fsync of the same bytes",
            "asynchronous save's blocked time / synchronous save")


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    try:
        checkpoint_bench = importlib.import_module("bench.checkpoint_bench")
    except ModuleNotFoundError as missing:
        if missing.name != "bench.checkpoint_bench":
            raise
        reason = "not measured (bench/checkpoint_bench.py is not in this tree)"
        return FigureResult(7, "checkpoint", TITLE, [Row(measure, None, notes=reason) for measure in EXPECTED])
    measured: dict[str, Any] = checkpoint_bench.run(ctx.quick)
    rows = [_row(key, value) for key, value in measured.items() if _is_ratio(value)]
    if not rows:
        raise ValueError(f"bench.checkpoint_bench.run returned no ratio: {sorted(measured)}")
    return FigureResult(7, "checkpoint", TITLE, rows,
                        {"checkpoint_bench": measured, "load_average": [load_before, load_average()]})


def _is_ratio(value: Any) -> bool:
    number = value.get("ratio") if isinstance(value, dict) else value
    return isinstance(number, int | float) and not isinstance(number, bool)


def _row(key: str, value: Any) -> Row:
    if isinstance(value, dict):
        return Row(str(value.get("measure", key)), float(value["ratio"]), notes=str(value.get("notes", "")))
    return Row(key.replace("_", " "), float(value))
