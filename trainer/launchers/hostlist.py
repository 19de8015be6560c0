"""Slurm's compressed lists: host names (``node[01-03,07],gpu-a[1-2]``) and per-node counts (``2(x3),1``).

Read without Slurm's tools: a trainer in a container has no ``scontrol show hostnames``.
"""

from __future__ import annotations

import re

from trainer.errors import LaunchEnvError

__all__ = ["expand_counts", "expand_hostlist"]

_RANGE = re.compile(r"(\d+)(?:-(\d+))?$")
_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?$")


def _top_level_items(text: str) -> list[str]:
    """Split on the commas that are outside brackets."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise LaunchEnvError(f"unbalanced brackets in the host list {text!r}")
        if char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if depth:
        raise LaunchEnvError(f"unbalanced brackets in the host list {text!r}")
    items.append(text[start:])
    return items


def _expand_brackets(item: str, whole: str) -> list[str]:
    """One item, possibly with several bracket groups (``rack[1-2]-n[01-02]``), into host names in order."""
    opening = item.find("[")
    if opening < 0:
        return [item]
    closing = item.index("]", opening)
    prefix, ranges, rest = item[:opening], item[opening + 1:closing], item[closing + 1:]
    names = []
    for part in ranges.split(","):
        match = _RANGE.match(part.strip())
        if not part.strip() or match is None:
            raise LaunchEnvError(f"{part!r} in the host list {whole!r} is not a number or a range like 01-04")
        first, last = match[1], match[2] or match[1]
        if int(last) < int(first):
            raise LaunchEnvError(f"the range {part!r} in the host list {whole!r} runs backwards")
        width = len(first)  # node[01-10]: the zero padding of the first number holds for all
        names += [f"{prefix}{number:0{width}d}" for number in range(int(first), int(last) + 1)]
    return [name + suffix for name in names for suffix in _expand_brackets(rest, whole)]


def expand_hostlist(text: str) -> list[str]:
    """``n[1-2],gpu07`` -> ``["n1", "n2", "gpu07"]``, in Slurm's order (the first is node 0)."""
    hosts = [host for item in _top_level_items(text.strip()) if item for host in _expand_brackets(item, text)]
    if not hosts:
        raise LaunchEnvError(f"the host list {text!r} names no host")
    return hosts


def expand_counts(text: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]``: SLURM_TASKS_PER_NODE and the like, one count per node."""
    counts = []
    for part in text.strip().split(","):
        match = _COUNT.match(part.strip())
        if match is None:
            raise LaunchEnvError(f"{part!r} in the per-node counts {text!r} is not N or N(xM)")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts
