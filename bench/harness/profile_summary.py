"""What a --profile-steps run's files say, small enough for results.json: the trace's GPU kernel time by kernel,
its copies, FSDP's own ranges, and what the allocator held at its peak, by where it was allocated.

The files themselves (a ResNet-50 trace is tens of MB) do not come back from a lent GPU machine; these summaries
do. They answer figure 4's question, where FSDP's time and memory at one rank go, beside DDP's.
"""

from __future__ import annotations

import json
import pickle
import re
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["memory_summary", "profile_summary", "trace_summary"]

_STEP = re.compile(r"ProfilerStep#(\d+)")
TOP = 12  # kernels and allocation sites listed
GIB = 2**30


def profile_summary(output_dir: Path, rank: int = 0) -> dict[str, Any]:
    """The summaries of one rank's profile under ``output_dir/profiles`` (the memory one only where there is a
    snapshot: CUDA runs)."""
    folder = output_dir / "profiles"
    summary: dict[str, Any] = {"trace": trace_summary(folder / f"rank-{rank}.pt.trace.json")}
    snapshot = folder / f"rank-{rank}.memory.pickle"
    if snapshot.is_file():
        summary["memory"] = memory_summary(snapshot)
    return summary


def trace_summary(path: Path) -> dict[str, Any]:
    """Per profiled step: wall time, GPU kernel time (all kernels, and the most expensive ones by name), copies
    and fills on the GPU, and the host time inside FSDP's own ranges (FSDP::...)."""
    events = [event for event in json.loads(path.read_text())["traceEvents"] if event.get("ph") == "X"]
    steps = [event for event in events if _STEP.fullmatch(str(event.get("name")))]
    count = max(1, len(steps))
    kernels: Counter[str] = Counter()
    launches: Counter[str] = Counter()
    copies, fsdp = Counter(), Counter()
    for event in events:
        category, name, duration = event.get("cat"), str(event.get("name")), float(event.get("dur", 0))
        if category == "kernel":
            kernels[name[:120]] += duration
            launches[name[:120]] += 1
        elif category in ("gpu_memcpy", "gpu_memset"):
            copies[name[:60]] += duration
        elif category in ("cpu_op", "user_annotation") and name.startswith("FSDP::"):
            fsdp[name] += duration

    def per_step_ms(microseconds: float) -> float:
        return round(microseconds / count / 1000, 3)

    return {
        "steps": len(steps),
        "step_ms": sorted(round(float(step.get("dur", 0)) / 1000, 3) for step in steps),
        "kernel_ms_per_step": per_step_ms(sum(kernels.values())),
        "kernels_per_step": round(sum(launches.values()) / count, 1),
        "top_kernels": [{"name": name, "ms_per_step": per_step_ms(total), "launches_per_step": launches[name] / count}
                        for name, total in kernels.most_common(TOP)],
        "copies_ms_per_step": {name: per_step_ms(total) for name, total in copies.most_common(TOP)},
        "fsdp_host_ms_per_step": {name: per_step_ms(total) for name, total in fsdp.most_common(TOP)},
    }


def memory_summary(path: Path) -> dict[str, Any]:
    """The allocator's history (torch.cuda.memory._dump_snapshot) replayed: the most memory allocated at once in
    the recorded steps above what was held when recording began, and the blocks live at that moment grouped by
    the frame that allocated them (the innermost FSDP frame, else the innermost of this project, else the
    innermost Python frame)."""
    snapshot = pickle.loads(path.read_bytes())
    trace = next((device for device in snapshot.get("device_traces", []) if device), [])
    live: dict[int, int] = {}
    current = peak = 0
    peak_at = -1
    for position, event in enumerate(trace):
        action, address, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if action == "alloc":
            live[address] = size
            current += size
            if current > peak:
                peak, peak_at = current, position
        elif action == "free_completed" and address in live:
            current -= live.pop(address)
    held: Counter[str] = Counter()
    alive: dict[int, tuple[int, str]] = {}
    for event in trace[:peak_at + 1]:
        if event.get("action") == "alloc":
            alive[event["addr"]] = (int(event.get("size", 0)), _site(event.get("frames", [])))
        elif event.get("action") == "free_completed":
            alive.pop(event.get("addr"), None)
    for size, site in alive.values():
        held[site] += size
    active = sum(int(block.get("size", 0)) for segment in snapshot.get("segments", [])
                 for block in segment.get("blocks", []) if block.get("state") == "active_allocated")
    return {"events": len(trace), "peak_above_start_gib": round(peak / GIB, 3),
            "active_at_dump_gib": round(active / GIB, 3),
            "at_peak_by_site_gib": {site: round(size / GIB, 3) for site, size in held.most_common(TOP)}}


def _site(frames: list[dict[str, Any]]) -> str:
    python = [frame for frame in frames if str(frame.get("filename", "")).endswith(".py")]
    for wanted in ("torch/distributed/fsdp", "/trainer/"):
        frame = next((frame for frame in python if wanted in str(frame["filename"])), None)
        if frame is not None:
            return f"{_short_path(frame['filename'])}:{frame.get('line')} {frame.get('name')}"
    if python:
        frame = python[0]
        return f"{_short_path(frame['filename'])}:{frame.get('line')} {frame.get('name')}"
    return "(no Python frame)"


def _short_path(filename: str) -> str:
    for root in ("torch/", "trainer/", "bench/"):
        if root in filename:
            return root + filename.split(root, 1)[1]
    return filename.rsplit("/", 1)[-1]
