"""Whether this node's NVIDIA driver is new enough for the CUDA this torch was built with.

torch gives no reason when its CUDA cannot start on the driver: ``torch.cuda.device_count()`` is 0 (with a
warning few read) and a run under ``--device auto`` trains on the CPU. So the driver's version is read here,
from the kernel module's /proc/driver/nvidia/version, else from nvidia-smi, never by starting CUDA, and
compared with NVIDIA's minimum for torch's CUDA major. What to do with the answer (refuse, warn, report)
is the caller's: trainer.distributed at start, trainer.doctor.driver in the preflight.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.errors import first_line

__all__ = ["MINIMUM_DRIVER", "NO_CUDA", "OK", "THIS_NODE", "TOO_OLD", "UNKNOWN", "DriverCheck", "NodeSources",
           "attached_gpus", "driver_check", "driver_in_version_file", "no_device_refusal", "parse_version",
           "start_failure", "working_cuda_warning"]

# The oldest Linux driver a CUDA major runs on under minor-version compatibility (any 12.x on >= 525.60.13):
# NVIDIA's CUDA Toolkit release notes, table "CUDA Toolkit and Minimum Required Driver Version for CUDA Minor
# Version Compatibility", and the CUDA Compatibility guide's "CUDA Toolkit 11.x, 12.x, and 13.x Driver Version
# Ranges" (docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html). docs/containers.md
# states the same numbers for the images.
MINIMUM_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580"}

OK, TOO_OLD, UNKNOWN, NO_CUDA = "ok", "too old", "unknown", "no CUDA"

NVIDIA_SMI_TIMEOUT_S = 10.0  # it answers in well under a second; a hung driver must not hang the start
DRIVER_VERSION = re.compile(r"\d+(?:\.\d+)+")  # 535.104.05; a bare number (a date's day) is not one
GPU_DEVICE = re.compile(r"nvidia\d+")  # /dev/nvidia0...; not nvidiactl, nvidia-uvm, nvidia-modeset


@dataclass(frozen=True)
class NodeSources:
    """Where this node's facts are read. THIS_NODE is the real node; the tests point these elsewhere."""

    version_file: Path = Path("/proc/driver/nvidia/version")
    nvidia_smi: str = "nvidia-smi"  # looked up on PATH, asked only when version_file gives no version
    nvidia_smi_timeout_s: float = NVIDIA_SMI_TIMEOUT_S
    # The GPUs given to this container show as device files; a CPU container on a GPU host has none, though
    # it sees the host's /proc/driver/nvidia.
    device_dir: Path = Path("/dev")
    cuda_version: str | None = field(default_factory=lambda: torch.version.cuda)  # None: a CPU build of torch
    cuda_devices: Callable[[], int] = torch.cuda.device_count


THIS_NODE = NodeSources()


def parse_version(text: str) -> tuple[int, ...] | None:
    """``535.104.05`` as (535, 104, 5), ``580`` as (580,); None for anything else."""
    text = text.strip()
    return tuple(int(part) for part in text.split(".")) if re.fullmatch(r"\d+(?:\.\d+)*", text) else None


def driver_in_version_file(text: str) -> str | None:
    """The driver's version in /proc/driver/nvidia/version: the first dotted number of its NVRM line, whichever
    kernel module wrote it ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 ...", or
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build ..."). Not the GCC line's."""
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            return next((token for token in line.split() if DRIVER_VERSION.fullmatch(token)), None)
    return None


@dataclass(frozen=True)
class DriverCheck:
    """This node's driver against this torch's CUDA."""

    cuda: str | None  # torch.version.cuda: the CUDA torch was built with; None on a CPU build
    minimum: str | None  # MINIMUM_DRIVER for that CUDA's major; None where the table has none
    driver: str | None  # the node's driver version, as NVIDIA writes it; None where none was found
    found: str  # where ``driver`` was read, or why there is none

    @property
    def verdict(self) -> str:
        if self.cuda is None:
            return NO_CUDA
        installed, needed = parse_version(self.driver or ""), parse_version(self.minimum or "")
        if installed is None or needed is None:
            return UNKNOWN
        return OK if installed >= needed else TOO_OLD

    def too_old(self) -> str:
        """The one line for a driver below the minimum, with what to do."""
        return (f"NVIDIA driver {self.driver} is older than {self.minimum}, the oldest this torch's CUDA "
                f"{self.cuda} runs on: update the node's driver, or use a torch built for an older CUDA "
                f"(docs/containers.md)")

    def describe(self) -> str:
        """What was found, in a phrase, whatever the verdict."""
        verdict = self.verdict
        if verdict == NO_CUDA:
            return "this torch is a CPU build, without CUDA"
        if verdict == TOO_OLD:
            return self.too_old()
        needs = (f"this torch's CUDA {self.cuda} needs a driver >= {self.minimum}" if self.minimum else
                 f"no minimum driver known for this torch's CUDA {self.cuda}")
        found = self.found if self.driver is None else f"NVIDIA driver {self.driver} ({self.found})"
        return f"{found}; {needs}"


def driver_check(node: NodeSources | None = None) -> DriverCheck:
    """The node's driver and torch's CUDA compared; reads nothing for a CPU build of torch."""
    node = node or THIS_NODE
    cuda = node.cuda_version
    if cuda is None:
        return DriverCheck(None, None, None, "")
    major = cuda.split(".")[0]
    minimum = MINIMUM_DRIVER.get(int(major)) if major.isdigit() else None
    driver, found = _read_driver(node)
    return DriverCheck(cuda, minimum, driver, found)


def _read_driver(node: NodeSources) -> tuple[str | None, str]:
    """The driver's version and where it was read, or None and why not."""
    file_absent = False
    try:
        text = node.version_file.read_text(errors="replace")
    except FileNotFoundError:
        file_absent, tried = True, f"no {node.version_file}"
    except OSError as error:
        tried = f"{node.version_file} unreadable ({error.strerror or error})"
    else:
        version = driver_in_version_file(text)
        if version is not None:
            return version, str(node.version_file)
        tried = f"no driver version in {node.version_file} ({_opening(text)!r})"
    version, said = _ask_nvidia_smi(node.nvidia_smi, node.nvidia_smi_timeout_s)
    if version is not None:
        return version, said
    none_here = file_absent and said == f"no {node.nvidia_smi} on PATH"
    return None, f"{'no NVIDIA driver found' if none_here else 'NVIDIA driver version unknown'} ({tried}, {said})"


def _ask_nvidia_smi(command: str, timeout_s: float) -> tuple[str | None, str]:
    path = shutil.which(command)
    if path is None:
        return None, f"no {command} on PATH"
    try:
        child = subprocess.Popen([path, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as error:
        return None, f"{command} failed ({first_line(error)})"
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # Not subprocess.run's kill-then-wait: a wedged driver leaves nvidia-smi in uninterruptible sleep, which no
        # kill ends, and a wait without a bound would hang the start. It is left behind; the start goes on.
        child.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=1)
        return None, f"{command} failed (no answer in {timeout_s:g} s)"
    answer = stdout.strip().splitlines()
    if child.returncode == 0 and answer and DRIVER_VERSION.fullmatch(answer[0].strip()):
        return answer[0].strip(), command  # one line per GPU; a node has one driver
    said = _opening(stdout + stderr)
    return None, f"{command} gave no driver version (exit {child.returncode}: {said!r})"


def attached_gpus(node: NodeSources | None = None) -> list[str]:
    """The GPU device files this process sees (nvidia0, nvidia1, ...): the GPUs its container was given."""
    node = node or THIS_NODE
    try:
        return sorted((entry.name for entry in node.device_dir.iterdir() if GPU_DEVICE.fullmatch(entry.name)),
                      key=lambda name: int(name.removeprefix("nvidia")))
    except OSError:
        return []


# When to refuse, and when only to warn. A driver below the table's minimum is not always fatal: NVIDIA's
# forward-compatibility package (cuda-compat, on data-center GPUs) brings a newer user-space libcuda into the
# container, and /proc reports the older kernel module. So a run is refused only when CUDA really failed to
# start AND the driver is known to be too old (then that is the reason, and the fix is known); where CUDA
# started anyway, one warning line; where the driver is new enough or unknown, nothing changes.


def no_device_refusal(requested: str, check: DriverCheck, node: NodeSources | None = None) -> str | None:
    """The line that ends a run whose CUDA counted no device, when the too-old driver is why: under
    --device cuda, or under auto where GPUs are attached (auto would have used them). None otherwise: a
    container without GPUs trains on the CPU under auto, as it always did."""
    if check.verdict != TOO_OLD or requested == "cpu":
        return None
    if requested == "cuda":
        return f"CUDA cannot start: {check.too_old()}"
    gpus = attached_gpus(node)
    if not gpus:
        return None
    return (f"CUDA cannot start on this node's GPUs ({', '.join(gpus)}), so --device auto would train on the CPU "
            f"(--device cpu does so on purpose): {check.too_old()}")


def start_failure(error: BaseException, node: NodeSources | None = None) -> str | None:
    """The line for CUDA that counted GPUs yet failed to start (an NVML-based count,
    PYTORCH_NVML_BASED_CUDA_CHECK=1, counts without starting CUDA), when the driver is too old; None otherwise."""
    check = driver_check(node)
    said = first_line(error).split(". ")[0]  # torch's first sentence; the rest is its generic advice
    return f"CUDA cannot start ({said}): {check.too_old()}" if check.verdict == TOO_OLD else None


def working_cuda_warning(check: DriverCheck) -> str | None:
    """The warning for CUDA that started on a driver below the minimum (see the reasoning above)."""
    if check.verdict != TOO_OLD:
        return None
    return (f"NVIDIA driver {check.driver} is older than {check.minimum}, the oldest this torch's CUDA {check.cuda} "
            f"runs on, yet CUDA started (NVIDIA's forward-compatibility package?): training goes on; if CUDA calls "
            f"fail, update the node's driver (docs/containers.md)")


def _opening(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:80]
