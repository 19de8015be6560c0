"""What a figure measured, and how it is written: results.json for tools, results.md for people.

Every figure is one or more rows; each row is a ratio between two things measured in the same
invocation (absolute times on a shared machine mean little), with the goal it is held to, if any.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Goal:
    """A bound on a ratio: ``>= 0.9`` (bigger is better) or ``<= 0.6`` (smaller is better)."""

    op: str
    value: float

    def __post_init__(self) -> None:
        if self.op not in (">=", "<="):
            raise ValueError(f"goal operator must be >= or <=, got {self.op!r}")

    def met(self, ratio: float) -> bool:
        return ratio >= self.value if self.op == ">=" else ratio <= self.value

    def __str__(self) -> str:
        return f"{'≥' if self.op == '>=' else '≤'} {self.value:.2f}"


@dataclass
class Row:
    measure: str  # what over what, e.g. "2 ranks / (2 × 1 process)"
    ratio: float | None  # None: not measured (the notes say why)
    goal: Goal | None = None
    notes: str = ""
    spread: tuple[float, float] | None = None  # lowest and highest per-round ratio behind the median

    @property
    def met(self) -> bool | None:
        if self.goal is None or self.ratio is None:
            return None
        return self.goal.met(self.ratio)


@dataclass
class FigureResult:
    number: int
    key: str  # the --only name
    title: str
    rows: list[Row]
    details: dict[str, Any] = field(default_factory=dict)  # what the rows were computed from, for plots and readers
    error: str | None = None  # the figure could not run to the end

    @classmethod
    def failed(cls, number: int, key: str, title: str, error: str) -> FigureResult:
        return cls(number, key, title, [Row("—", None, notes=f"failed: {error}")], error=error)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for row, raw in zip(self.rows, data["rows"], strict=True):
            raw["goal"] = None if row.goal is None else {"op": row.goal.op, "value": row.goal.value}
            raw["met"] = row.met
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FigureResult:
        rows = []
        for raw in data["rows"]:
            goal = raw.get("goal")
            spread = raw.get("spread")
            rows.append(Row(raw["measure"], raw["ratio"], Goal(goal["op"], goal["value"]) if goal else None,
                            raw.get("notes", ""), tuple(spread) if spread else None))
        return cls(data["number"], data["key"], data["title"], rows, data.get("details", {}), data.get("error"))


def write_json(path: Path, header: dict[str, Any], figures: list[FigureResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {**header, "figures": [figure.to_dict() for figure in sorted(figures, key=lambda f: f.number)]}
    path.write_text(json.dumps(document, indent=2, default=_plain) + "\n")


def read_json(path: Path) -> tuple[dict[str, Any], list[FigureResult]]:
    document = json.loads(path.read_text())
    figures = [FigureResult.from_dict(raw) for raw in document.pop("figures")]
    return document, figures


def _plain(value: Any) -> Any:
    """json.dumps fallback for tuples of numpy scalars and the like."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def markdown_table(figures: list[FigureResult]) -> str:
    lines = ["| # | figure | measured | ratio | goal | met? | notes |", "|---|---|---|---|---|---|---|"]
    for figure in sorted(figures, key=lambda f: f.number):
        for index, row in enumerate(figure.rows):
            name = f"{figure.title}" if index == 0 else ""
            number = str(figure.number) if index == 0 else ""
            lines.append(f"| {number} | {name} | {row.measure} | {format_ratio(row)} | "
                         f"{row.goal if row.goal else '—'} | {_met(row.met)} | {_cell(row.notes)} |")
    return "\n".join(lines)


def format_ratio(row: Row) -> str:
    if row.ratio is None or math.isnan(row.ratio):
        return "not measured"
    text = f"{row.ratio:.3f}"
    if row.spread is not None:
        text += f" ({row.spread[0]:.2f}–{row.spread[1]:.2f})"
    return text


def _met(met: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "—"}[met]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_markdown(path: Path, header: dict[str, Any], figures: list[FigureResult], plots: list[str]) -> None:
    machine = header["machine"]
    lines = [
        f"# Benchmark results ({'quick mode: not representative' if header['quick'] else 'full run'})",
        "",
        f"Run {header['started']} in {header['duration_s']:.0f} s on {machine['summary']}.",
        "Each ratio compares two things measured in the same invocation, interleaved and repeated; the value is the "
        "median of the per-round ratios, with the lowest and highest round in brackets.",
        f"Load average (1 min) of the machine, others' work included: {header['load_average']}.",
        "",
        markdown_table(figures),
        "",
    ]
    lines += [f"![{Path(name).stem}]({name})" for name in plots]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip() + "\n")
