"""The PNG plots of results.md and the README, drawn from the figures' rows and details only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: CI and containers have no display

import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
from matplotlib.figure import Figure  # noqa: E402

from bench.harness.results import FigureResult, Row  # noqa: E402

PART_COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "sync": "#c44e52", "optimizer": "#8172b2",
                "other": "#cccccc"}
SCHEDULER_COLOURS = {"running": "#4c72b0", "waiting for a core": "#dd8452", "blocked": "#c44e52"}


def make_plots(figures: list[FigureResult], out_dir: Path) -> list[str]:
    """Write every plot whose data is present; the file names written, relative to out_dir."""
    by_key = {figure.key: figure for figure in figures if figure.error is None}
    drawers: list[tuple[str, Callable[[dict[str, FigureResult]], Figure | None]]] = [
        ("summary.png", lambda _: _summary(figures)),
        ("scaling.png", _scaling),
        ("scheduling.png", _scheduling),
        ("step_parts.png", _step_parts),
        ("time_to_accuracy.png", _time_to_accuracy),
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in drawers:
        drawing = draw(by_key)
        if drawing is None:
            continue
        drawing.savefig(out_dir / name, dpi=110, bbox_inches="tight")
        plt.close(drawing)
        written.append(name)
    return written


def _summary(figures: list[FigureResult]) -> Figure | None:
    """Each figure's headline (its first row with a goal), measured ratio against the goal."""
    rows = []
    for figure in sorted(figures, key=lambda f: f.number):
        headline = next((row for row in figure.rows if row.goal is not None), None)
        if headline is not None and headline.ratio is not None:
            rows.append((figure, headline))
    if not rows:
        return None
    drawing, axes = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    labels = [f"{figure.number}. {_shorten(row.measure)}" for figure, row in rows]
    positions = range(len(rows))
    colours = ["#55a868" if row.met else "#c44e52" for _, row in rows]
    axes.barh(positions, [row.ratio for _, row in rows], color=colours)
    for position, (_, row) in zip(positions, rows, strict=True):
        assert row.goal is not None
        axes.plot([row.goal.value] * 2, [position - 0.4, position + 0.4], color="black", linewidth=2)
        axes.text(row.ratio, position, f" {row.ratio:.2f}", va="center", fontsize=8)
    axes.set_yticks(list(positions), labels, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("ratio (black mark: goal; green: met)")
    axes.set_title("Each figure's headline against its goal")
    return drawing


def _scaling(by_key: dict[str, FigureResult]) -> Figure | None:
    figure = by_key.get("scaling")
    if figure is None:
        return None
    rows = [row for row in figure.rows if row.ratio is not None]
    drawing, axes = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    positions = range(len(rows))
    axes.barh(positions, [row.ratio for row in rows], color="#4c72b0",
              xerr=_errors(rows), error_kw={"ecolor": "#555555", "capsize": 3})
    axes.axvline(0.9, color="black", linestyle="--", linewidth=1, label="goal 0.90")
    axes.set_yticks(list(positions), [_shorten(row.measure, 60) for row in rows], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlim(0, 1.1)
    axes.set_xlabel("throughput of 2 ranks / (2 × 1 process); bars: lowest and highest round")
    axes.set_title("Figure 1: scaling efficiency, ConvNet, batch 128 per rank, 1 thread per process")
    axes.legend(loc="lower right", fontsize=8)
    return drawing


def _scheduling(by_key: dict[str, FigureResult]) -> Figure | None:
    """Rank 0's step in figure 1's phases: running, waiting for a core others had, blocked on the other rank."""
    figure = by_key.get("scaling")
    parts = figure.details.get("step_parts_s", {}) if figure else {}
    if not parts:
        return None
    rows = {label: {"running": phase["main_thread_cpu"] * 1e3, "waiting for a core": phase["waiting_for_core"] * 1e3,
                    "blocked": phase["blocked"] * 1e3} for label, phase in parts.items()}
    return _stacked_bars(rows, SCHEDULER_COLOURS, "ms per optimizer step, rank 0's main thread (median round)",
                         "Figure 1: where a step's wall time goes")


def _step_parts(by_key: dict[str, FigureResult]) -> Figure | None:
    """Where a step's time goes: alone, beside a busy core, under DDP, and per sync method."""
    bars: dict[str, dict[str, float]] = {}
    if "scaling" in by_key:
        parts = by_key["scaling"].details.get("step_parts_s", {})
        names = {"single": "1 process", "independent": "2 processes, no sync", "ddp": "2 ranks, bare DDP"}
        bars.update({label: parts[name] for name, label in names.items() if name in parts})
    for key, prefix in (("sync", "--sync "), ("syncbn", "")):
        if key in by_key:
            bars.update({prefix + name: parts for name, parts in by_key[key].details.get("step_parts_s", {}).items()})
    if not bars:
        return None
    rows = {}
    for label, parts in bars.items():
        measured = {name: parts[name] * 1e3 for name in ("forward", "backward", "sync", "optimizer")}
        measured["other"] = max(parts["wall"] * 1e3 - sum(measured.values()), 0.0)
        rows[label] = measured
    return _stacked_bars(rows, PART_COLOURS, "ms per optimizer step on rank 0 (median round; same run per group of "
                         "bars)", "Where a step's time goes (figures 1, 2, 6)")


def _stacked_bars(rows: dict[str, dict[str, float]], colours: dict[str, str], xlabel: str, title: str) -> Figure:
    """One horizontal bar per row, its segments stacked left to right in the colours given."""
    drawing, axes = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    for position, segments in enumerate(rows.values()):
        left = 0.0
        for name, width in segments.items():
            axes.barh(position, width, left=left, color=colours[name], label=name if position == 0 else None)
            left += width
    axes.set_yticks(list(range(len(rows))), list(rows), fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel(xlabel)
    axes.set_title(title)
    axes.legend(loc="lower right", fontsize=8)
    return drawing


def _time_to_accuracy(by_key: dict[str, FigureResult]) -> Figure | None:
    figure = by_key.get("accuracy")
    if figure is None or not figure.details.get("curves"):
        return None
    drawing, axes = plt.subplots(figsize=(7, 4))
    for label, curve in figure.details["curves"].items():
        seconds, accuracy = zip(*curve, strict=True) if curve else ((), ())
        axes.plot(seconds, accuracy, marker="o", label=label)
    axes.axhline(figure.details["target"], color="black", linestyle="--", linewidth=1,
                 label=f"target {figure.details['target']:.2f}")
    axes.set_xlabel("seconds since launch (test accuracy at each epoch's end)")
    axes.set_ylabel("test accuracy")
    axes.set_title("Figure 5: time to accuracy, same invocation")
    axes.legend(fontsize=8)
    return drawing


def _errors(rows: list[Row]) -> list[list[float]]:
    low = [row.ratio - row.spread[0] if row.spread else 0.0 for row in rows]
    high = [row.spread[1] - row.ratio if row.spread else 0.0 for row in rows]
    return [low, high]


def _shorten(text: str, limit: int = 48) -> str:
    text = text.replace("`", "")
    return text if len(text) <= limit else text[:limit - 1] + "…"
