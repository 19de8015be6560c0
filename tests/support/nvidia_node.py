"""A made-up node for trainer.cuda_driver: its /proc/driver/nvidia/version, nvidia-smi, GPU device files and
torch's CUDA, all in a temporary folder (the real node's facts are THIS_NODE's)."""

from __future__ import annotations

from pathlib import Path

from trainer.cuda_driver import NodeSources

# /proc/driver/nvidia/version as NVIDIA's two kernel modules write it.
PROPRIETARY = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
               "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
OPEN_MODULE = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
               "(dvs-builder@U22-I3-AF03-09-1)  Sun Jul 27 06:54:38 UTC 2025\n"
               "GCC version:  gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04)\n")


def version_line(driver: str) -> str:
    return f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver}  Sat Aug 19 01:15:15 UTC 2023\n"


def fake_node(folder: Path, version_file: str | None = None, cuda: str | None = "13.0", nvidia_smi: str | None = None,
              smi_exit: int = 0, gpus: int = 0, cuda_devices: int = 0) -> NodeSources:
    """``version_file``: the file's text (None: no file); ``nvidia_smi``: what a fake nvidia-smi prints, exiting
    ``smi_exit`` (None: none on PATH); ``gpus``: device files nvidia0... (and nvidiactl, which is no GPU);
    ``cuda_devices``: what torch counts."""
    folder.mkdir(parents=True, exist_ok=True)
    version_path = folder / "version"
    if version_file is not None:
        version_path.write_text(version_file)
    smi = "ddp-deploy-test-no-nvidia-smi"  # on no PATH
    if nvidia_smi is not None:
        script = folder / "nvidia-smi"
        script.write_text(f"#!/bin/sh\ncat <<'END'\n{nvidia_smi}\nEND\nexit {smi_exit}\n")
        script.chmod(0o755)
        smi = str(script)
    devices = folder / "dev"
    devices.mkdir(exist_ok=True)
    for name in ["nvidiactl", *(f"nvidia{index}" for index in range(gpus))]:
        (devices / name).touch()
    return NodeSources(version_file=version_path, nvidia_smi=smi, device_dir=devices, cuda_version=cuda,
                       cuda_devices=lambda: cuda_devices)
