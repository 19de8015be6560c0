"""Throughput in FLOPs: the model's FLOPs per sample counted once, FLOP/s per device and MFU where the peak is known.

The count is ``torch.utils.flop_counter.FlopCounterMode`` over one forward and backward pass of one batch, made
once at the start, on rank 0 alone, before the gradient sync wraps the model (under --sync fsdp/hsdp the count is
of the whole module). It runs on a copy of the model on the meta device, made without copying any weights, on the
batch moved there too: FLOPs follow shapes only, so the real model, its parameters, its buffers and the device's
memory are never touched, whatever the forward does (registers a buffer, renormalises an embedding in place), and
a model that fits for training fits for the count. Synchronised BatchNorm is counted as a plain one (the same
work, no collective): the other ranks never enter the pass, so nothing in it may wait for them. The random
generators are put back after it, so that a run with the count trains bitwise as one without it would.

It counts what the model computes: the matrix products and convolutions (attention too), not element-wise work; the
backward pass of a first layer, whose input needs no gradient, is one product, not two. A model or loss that cannot
run on the meta device (a custom kernel, a tensor kept outside the module) is one line in the log, and no figures.

MFU is the FLOP/s one device achieved over its dense peak at the run's --precision: ``PEAKS`` below, by the name
``torch.cuda.get_device_name()`` reports, each figure from NVIDIA's datasheet; --peak-tflops gives one by hand.
None is claimed for CPUs, nor for a MIG slice (a share of the GPU that no datasheet gives a peak for).
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.flop_counter import FlopCounterMode

from trainer.errors import described
from trainer.rng import capture_rng, restore_rng
from trainer.syncbn import GlooSyncBatchNorm
from trainer.task import batch_size, map_tensors

__all__ = ["NOT_COUNTED", "PEAKS", "FlopCount", "Peak", "Throughput", "count_flops", "device_peak", "meta_copy",
           "peak_for"]


@dataclass(frozen=True)
class DevicePeaks:
    """One GPU's dense peaks (no 2:4 sparsity) in TFLOP/s by --precision, and where they come from."""

    pattern: str  # searched (ignoring case) in the name torch.cuda.get_device_name() reports
    tflops: Mapping[str, float]
    source: str


# Dense TFLOP/s: where a datasheet gives a tensor-core figure only with 2:4 sparsity, half of it. fp32 is the CUDA
# cores' figure (this trainer's fp32 turns TF32 off); tf32, bf16 and fp16 are the tensor cores'. Volta and Turing have
# no TF32 (--precision tf32 computes in fp32 there) and no bf16 tensor cores: no bf16 figure, so no MFU at bf16.
# Variants first: the first pattern that matches wins. The A10G (AWS) has no NVIDIA datasheet: --peak-tflops.
PEAKS: tuple[DevicePeaks, ...] = (
    DevicePeaks(r"\bH100\b.*\bNVL\b", {"fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
                "NVIDIA H100 datasheet, H100 NVL: FP32 60; TF32 835, BF16/FP16 1,671 with sparsity"),
    DevicePeaks(r"\bH100\b.*\bPCIe\b", {"fp32": 51, "tf32": 378, "bf16": 756.5, "fp16": 756.5},
                "NVIDIA H100 datasheet, H100 PCIe: FP32 51; TF32 756, BF16/FP16 1,513 with sparsity"),
    DevicePeaks(r"\bH100\b", {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
                "NVIDIA H100 datasheet, H100 SXM: FP32 67; TF32 989, BF16/FP16 1,979 with sparsity"),
    DevicePeaks(r"\bH200\b.*\bNVL\b", {"fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
                "NVIDIA H200 datasheet, H200 NVL: FP32 60; TF32 835, BF16/FP16 1,671 with sparsity"),
    DevicePeaks(r"\bH200\b", {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
                "NVIDIA H200 datasheet, H200 SXM: FP32 67; TF32 989, BF16/FP16 1,979 with sparsity"),
    DevicePeaks(r"\bGH200\b", {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
                "NVIDIA GH200 Grace Hopper Superchip datasheet: FP32 67; TF32 989, BF16/FP16 1,979 with sparsity"),
    DevicePeaks(r"\bA100\b", {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},
                "NVIDIA A100 datasheet, SXM4 and PCIe alike: FP32 19.5; TF32 156, BF16/FP16 312 dense"),
    DevicePeaks(r"\bA30\b", {"fp32": 10.3, "tf32": 82, "bf16": 165, "fp16": 165},
                "NVIDIA A30 datasheet: FP32 10.3; TF32 82, BF16/FP16 165 dense"),
    DevicePeaks(r"\bA10\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125},
                "NVIDIA A10 datasheet: FP32 31.2; TF32 62.5, BF16/FP16 125 dense"),
    DevicePeaks(r"\bL40S\b", {"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05},
                "NVIDIA L40S datasheet: FP32 91.6; TF32 183, BF16/FP16 362.05 dense"),
    DevicePeaks(r"\bL40\b", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp16": 181.05},
                "NVIDIA L40 datasheet: FP32 90.5; TF32 90.5, BF16/FP16 181.05 dense"),
    DevicePeaks(r"\bL4\b", {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121},
                "NVIDIA L4 datasheet: FP32 30.3; TF32 120, BF16/FP16 242 with sparsity"),
    DevicePeaks(r"\bV100S\b", {"fp32": 16.4, "tf32": 16.4, "fp16": 130},
                "NVIDIA V100 datasheet, V100S PCIe: FP32 16.4; tensor (FP16) 130"),
    DevicePeaks(r"\bV100-PCIE\b", {"fp32": 14, "tf32": 14, "fp16": 112},
                "NVIDIA V100 datasheet, V100 PCIe: FP32 14; tensor (FP16) 112"),
    DevicePeaks(r"\bV100-SXM2\b", {"fp32": 15.7, "tf32": 15.7, "fp16": 125},
                "NVIDIA V100 datasheet, V100 SXM2: FP32 15.7; tensor (FP16) 125"),
    DevicePeaks(r"\bT4\b", {"fp32": 8.1, "tf32": 8.1, "fp16": 65},
                "NVIDIA T4 datasheet: FP32 8.1; mixed precision (FP16) 65"),
)


@dataclass(frozen=True)
class Peak:
    """One device's dense peak at the run's precision, or None; ``said``: where it comes from, or why none."""

    tflops: float | None
    said: str


def peak_for(device_name: str | None, precision: str, given_tflops: float = 0.0) -> Peak:
    """The peak of a device by the name torch reports (None: a CPU), at --precision; --peak-tflops wins."""
    if given_tflops:
        return Peak(given_tflops, f"MFU against --peak-tflops {given_tflops:g}")
    if device_name is None:
        return Peak(None, "no MFU: no peak is claimed for CPUs (--peak-tflops gives one)")
    if re.search(r"\bMIG\b", device_name):  # "NVIDIA H100 80GB HBM3 MIG 1g.10gb": the whole GPU's peak would not do
        return Peak(None, f"no MFU: {device_name} is a MIG slice, whose share of the GPU's peak no datasheet gives; "
                          f"--peak-tflops gives one")
    for device in PEAKS:
        if re.search(device.pattern, device_name, re.IGNORECASE):
            tflops = device.tflops.get(precision)
            if tflops is None:
                return Peak(None, f"no MFU: {device_name} has no {precision} figure in its datasheet "
                                  f"({device.source}); --peak-tflops gives one")
            return Peak(tflops, f"MFU against {tflops:g} TFLOP/s, the dense {precision} peak of {device_name} "
                                f"({device.source})")
    return Peak(None, f"no MFU: no peak known for {device_name!r} at --precision {precision}; give one device's dense "
                      f"peak (its datasheet's, without sparsity) with --peak-tflops, or add the device to PEAKS in "
                      f"trainer/throughput.py")


def device_peak(device: torch.device, precision: str, given_tflops: float = 0.0) -> Peak:
    return peak_for(torch.cuda.get_device_name(device) if device.type == "cuda" else None, precision, given_tflops)


@dataclass(frozen=True)
class FlopCount:
    """The FLOPs of one training sample, forward and backward (None: not counted), and the log's words on it."""

    flops_per_sample: float | None
    said: str


def count_flops(model: nn.Module, make_batch: Callable[[], tuple[Any, Any]], loss: Callable[[Any, Any], Tensor],
                autocast: Callable[[], AbstractContextManager[object]]) -> FlopCount:
    """One forward and backward pass of a meta-device copy of ``model`` on ``make_batch()``'s (inputs, targets),
    moved to the meta device, counted; ``model`` itself is not run (see the module's docstring). Never raises: a
    model the counter cannot run is one line, and no count."""
    started = time.perf_counter()
    try:
        generators = capture_rng()
        try:
            total, samples = _counted_pass(model, make_batch, loss, autocast)
        finally:
            # The batch's preparation may draw (a task's on_device augmentation); the meta device's dropout draws
            # nothing (torch 2.14), but a release that did must not shift training's random stream either.
            restore_rng(generators)
    except Exception as error:  # noqa: BLE001 - the count is a report: whatever stops it, training goes on
        return FlopCount(None, f"FLOPs not counted (torch.utils.flop_counter could not run the model's forward and "
                               f"backward on the meta device: {described(error)}; see docs/tasks.md); no FLOP/s or "
                               f"MFU reported")
    seconds = time.perf_counter() - started
    if not total:
        return FlopCount(None, "FLOPs not counted: torch.utils.flop_counter saw no matrix product or convolution in "
                               "the model's forward and backward (custom kernels it cannot see?); no FLOP/s or MFU "
                               "reported")
    return FlopCount(total / samples, f"{si(total / samples, 'FLOP')} per sample (forward and backward, counted by "
                                      f"torch.utils.flop_counter on one batch of {samples}, on the meta device, in "
                                      f"{seconds:.2f} s)")


def _counted_pass(model: nn.Module, make_batch: Callable[[], tuple[Any, Any]], loss: Callable[[Any, Any], Tensor],
                  autocast: Callable[[], AbstractContextManager[object]]) -> tuple[int, int]:
    """The FLOPs of one forward and backward pass on the meta device, and the batch's samples."""
    shadow = meta_copy(model)
    parameters = [parameter for parameter in shadow.parameters() if parameter.requires_grad]
    inputs, targets = (map_tensors(part, lambda tensor: tensor.to("meta")) for part in make_batch())
    with FlopCounterMode(display=False) as counter:
        with autocast():
            value = loss(shadow(inputs), targets)
        # torch.autograd.grad, not backward(): no .grad is kept, and no hook of a parameter runs.
        torch.autograd.grad(value, parameters, allow_unused=True)
    return counter.get_total_flops(), batch_size(targets)


def meta_copy(model: nn.Module) -> nn.Module:
    """``model`` on the meta device, its weights not copied: every parameter, buffer and tensor a module keeps is an
    empty meta tensor of its shape (tied weights stay tied: one tensor, one copy). A synchronised BatchNorm becomes
    a plain one, which issues no collective."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, nn.SyncBatchNorm | GlooSyncBatchNorm):
            memo[id(module)] = _local_batchnorm(module)
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False),
                       *(value for value in vars(module).values() if isinstance(value, Tensor))):
            memo.setdefault(id(tensor), _on_meta(tensor))
    return copy.deepcopy(model, memo)


def _on_meta(tensor: Tensor) -> Tensor:
    empty = torch.empty_like(tensor, device="meta")
    return nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty


class _LocalBatchNorm(_BatchNorm):
    """A synchronised BatchNorm's stand-in in the count: the same shapes and work, this rank's batch alone."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {input.dim()}D input")


def _local_batchnorm(synchronised: _BatchNorm) -> _BatchNorm:
    local = _LocalBatchNorm(synchronised.num_features, synchronised.eps, synchronised.momentum, synchronised.affine,
                            synchronised.track_running_stats, device="meta", bias=synchronised.bias is not None)
    for name, tensor in (*synchronised.named_parameters(recurse=False), *synchronised.named_buffers(recurse=False)):
        setattr(local, name, _on_meta(tensor))
    return local.train(synchronised.training)


@dataclass(frozen=True)
class Throughput:
    """What a samples/s figure is in FLOP/s per device and in MFU, for the log line, metrics.jsonl and the summary
    (rank 0's: the other ranks report none of them, and hold ``NOT_COUNTED``)."""

    flops_per_sample: float | None
    peak: Peak
    devices: int  # the devices the samples/s are shared by: the world size (times the GPUs of --sync dp)

    def flops_per_s_per_device(self, samples_per_s: float) -> float | None:
        if self.flops_per_sample is None:
            return None
        return self.flops_per_sample * samples_per_s / self.devices

    def mfu(self, samples_per_s: float) -> float | None:
        achieved = self.flops_per_s_per_device(samples_per_s)
        if achieved is None or self.peak.tflops is None:
            return None
        return achieved / (self.peak.tflops * 1e12)

    def record(self, samples_per_s: float) -> dict[str, float]:
        """metrics.jsonl's and TensorBoard's values: only those known."""
        values = {"flops_per_s_per_device": self.flops_per_s_per_device(samples_per_s),
                  "mfu": self.mfu(samples_per_s)}
        return {name: value for name, value in values.items() if value is not None}

    def summary(self, samples_per_s: float) -> dict[str, float]:
        """summary.json's fields, beside train_samples_per_s: only those known."""
        achieved, mfu = self.flops_per_s_per_device(samples_per_s), self.mfu(samples_per_s)
        values = {"flops_per_sample": None if self.flops_per_sample is None else round(self.flops_per_sample),
                  "train_flops_per_s_per_device": None if achieved is None else round(achieved, 1),
                  "peak_tflops": self.peak.tflops if mfu is not None else None,
                  "train_mfu": None if mfu is None else round(mfu, 4)}
        return {name: value for name, value in values.items() if value is not None}

    def shown(self, samples_per_s: float) -> str:
        """`` (4.1 TFLOP/s per device, MFU 41.2%)`` after the log line's samples/s; empty when not counted."""
        achieved, mfu = self.flops_per_s_per_device(samples_per_s), self.mfu(samples_per_s)
        if achieved is None:
            return ""
        return f" ({si(achieved, 'FLOP/s')} per device{'' if mfu is None else f', MFU {mfu:.1%}'})"


NOT_COUNTED = Throughput(None, Peak(None, "not counted: rank 0 counts and reports"), devices=1)


def si(value: float, unit: str) -> str:
    """``4.12 TFLOP/s``: three significant digits and a decimal prefix."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"
