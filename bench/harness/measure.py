"""Ratios that survive a noisy machine: cases interleaved round by round, medians of per-round ratios.

Other people's jobs can slow one run several-fold. Running case A then case B, round after round,
exposes both to the same slow spells, and the median of the rounds' A/B ratios ignores the worst ones.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ratio:
    median: float
    low: float
    high: float
    rounds: list[float]

    @property
    def spread(self) -> tuple[float, float]:
        return (self.low, self.high)


def interleave(cases: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each case once per round, in the given order; every case's values, round by round."""
    values: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            values[name].append(case())
    return values


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> Ratio:
    """Median of numerator/denominator taken round by round (both measured in the same round)."""
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(f"need the same number of rounds on both sides, got {len(numerators)} and "
                         f"{len(denominators)}")
    ratios = [a / b for a, b in zip(numerators, denominators, strict=True)]
    return Ratio(statistics.median(ratios), min(ratios), max(ratios), ratios)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def load_average() -> float:
    """The 1-minute load average: how busy the machine is with everyone's work."""
    return round(os.getloadavg()[0], 2)


def describe_machine() -> dict[str, object]:
    cpu = _cpu_model()
    cores = os.cpu_count() or 1
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = describe_gpu()
    summary = (f"{cpu}, {cores} cores, {memory_gib:.0f} GiB RAM, Linux {platform.release()}, "
               f"Python {platform.python_version()}, torch {torch.__version__}")
    if gpu:
        summary = f"{gpu['name']} ({gpu['memory_gib']:.0f} GiB, driver {gpu['driver']}, CUDA {gpu['cuda']}), " + summary
    return {"cpu": cpu, "cores": cores, "memory_gib": round(memory_gib, 1), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, **({"gpu": gpu} if gpu else {}),
            "summary": summary}


def describe_gpu() -> dict[str, object] | None:
    """The first CUDA device, its driver and the CUDA version torch was built with; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=True).stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = "unknown"
    return {"name": properties.name, "memory_gib": round(properties.total_memory / 2**30, 1), "driver": driver,
            "cuda": torch.version.cuda, "count": torch.cuda.device_count()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
