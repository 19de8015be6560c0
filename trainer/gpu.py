"""What a GPU run sets up that a CPU run does not: channels-last memory and cuDNN's autotuner where they
help, TF32 as --precision says, NCCL's asynchronous error handling with a timeout placed after the trainer's
own diagnosis, and the advice a timed-out NCCL collective needs (the flight recorder is
trainer.flight_recorder's, for every backend).

Everything here is decided from the config and the device, and told in one log line (``describe``); none of
it changes what a CPU run does.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer.task import map_tensors

__all__ = ["DeviceTuning", "apply_nccl_environment", "checkpoint_layout", "choose_tuning", "nccl_environment",
           "nccl_timeout_advice", "peak_memory", "set_tf32"]

NCCL_DEFAULTS = {
    # A collective past NCCL's timeout aborts its communicator and ends the process (the launcher restarts the
    # job), instead of leaving a GPU kernel spinning on a peer that is gone. NCCL's timeout is later than
    # --collective-timeout-s (trainer.distributed.nccl_timeout_s): the trainer's own diagnosis comes first.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # NCCL's watchdog also dumps the flight recorder (trainer.flight_recorder) when it fires.
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}


@dataclass(frozen=True)
class DeviceTuning:
    """Per-run choices that only matter on CUDA."""

    channels_last: bool  # 4-D inputs, and so the activations, in NHWC: cuDNN's tensor-core convolutions want it
    cudnn_benchmark: bool  # cuDNN times its algorithms for each new input shape and keeps the fastest
    # The weights in NHWC too. Not under a sharded --sync: FSDP2 shards and gathers contiguous parameters only
    # (it refuses others: pytorch/pytorch#166291). A convolution whose input is channels-last runs channels-last
    # whatever its weight's layout (torch converts the weight for the call), so the activations keep the layout.
    weights_channels_last: bool = True

    def apply(self, model: nn.Module) -> nn.Module:
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        return model.to(memory_format=torch.channels_last) if self.channels_last and self.weights_channels_last \
            else model

    def inputs(self, batch: Any) -> Any:
        """A batch's 4-D tensors in channels-last layout (after the copy to the device); others unchanged."""
        if not self.channels_last:
            return batch
        return map_tensors(batch, lambda tensor: tensor.contiguous(memory_format=torch.channels_last)
                           if tensor.dim() == 4 else tensor)

    def describe(self) -> str:
        activations = " (activations only: sharded parameters stay contiguous)" if self.channels_last and not \
            self.weights_channels_last else ""
        return (f"channels-last {'on' if self.channels_last else 'off'}{activations}, cuDNN autotuner "
                f"{'on' if self.cudnn_benchmark else 'off'}")


def choose_tuning(channels_last: str, cudnn_benchmark: str, device: torch.device, model: nn.Module,
                  trained_channels_last: bool | None = None, sharded: bool = False) -> DeviceTuning:
    """``auto`` means: on CUDA, channels-last for a model with 2-D convolutions and the autotuner for any
    model (a run's input shapes repeat: the one-off timing pays back within steps). Off on the CPU, where
    cuDNN does not run and NHWC changes the arithmetic's order: CPU runs keep their exact numbers, and a
    checkpoint written before this option resumes bitwise; ``on`` asks for NHWC there too.

    ``trained_channels_last``: the layout the checkpoint being resumed was trained in (``checkpoint_layout``).
    ``auto`` keeps it, whatever the device: a convolution's results differ in their last bits between the two
    layouts, so only the checkpoint's layout continues bitwise like an uninterrupted run (a GPU checkpoint
    resumed on CPU stays channels-last). ``on`` and ``off`` are obeyed.

    ``sharded``: the parameters stay contiguous (FSDP's), and only the inputs change layout; a sharded
    checkpoint's weights say nothing of the layout it trained in, so ``auto`` decides by the device alone."""
    cuda = device.type == "cuda"
    has_conv = any(isinstance(module, nn.Conv2d) for module in model.modules())
    automatic = cuda and has_conv if trained_channels_last is None or sharded else trained_channels_last
    return DeviceTuning(channels_last=_decide(channels_last, automatic),
                        cudnn_benchmark=_decide(cudnn_benchmark, cuda), weights_channels_last=not sharded)


def checkpoint_layout(model_state: Mapping[str, Any]) -> bool:
    """Whether a saved model state was trained channels-last: its 4-D weights keep the layout they had (torch.save
    and the asynchronous save's buffers keep strides). A weight whose layout is ambiguous (1x1 kernels of one
    channel are both) says nothing; a model without 4-D weights is not channels-last."""
    for tensor in model_state.values():
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 4 and not tensor.is_contiguous():
            return tensor.is_contiguous(memory_format=torch.channels_last)
        if isinstance(tensor, dict) and "channels_last" in tensor:  # a marker (trainer.checkpoint.state_file)
            return bool(tensor["channels_last"])
    return False


def set_tf32(precision: str) -> str:
    """TF32 for the float32 matrix multiplications and convolutions on CUDA, from --precision: on only for
    ``tf32``. Under fp32 a float32 result is computed in float32 (cuDNN's convolutions default to TF32, cuBLAS's
    matmuls do not: left alone, the two would differ, and a GPU run would differ from a CPU run by TF32's 10-bit
    mantissa rather than by the order of its sums). Under bf16 and fp16 autocast computes the matmuls and
    convolutions in that type; what it leaves in float32 (losses, norms) is precision-sensitive and stays so.
    Returns what was set, for the log. CPU kernels are not touched; --precision decides over a task's own
    ``torch.set_float32_matmul_precision``.

    Set through ``allow_tf32`` (cuDNN's covers its convolutions and RNNs): torch >= 2.9's ``fp32_precision``
    settings, once used, make every later read of ``allow_tf32`` (torch.compile's convolution templates, user
    code, ``cudnn.flags()``) raise as "a mix of the legacy and new APIs", even when all of them agree."""
    on = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    return f"TF32 {'on' if on else 'off'} for float32 matmuls, convolutions and RNNs"


def _decide(setting: str, auto: bool) -> bool:
    return auto if setting == "auto" else setting == "on"


def nccl_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL settings this run adds to its environment, each only where the user has not set it."""
    return {name: value for name, value in NCCL_DEFAULTS.items() if name not in environ}


def apply_nccl_environment(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set nccl_environment's values before the NCCL process group exists (it reads them when created)."""
    added = nccl_environment(environ)
    environ.update(added)
    return added


def nccl_timeout_advice() -> str:
    """What to do after an NCCL collective timed out, besides the flight recorder's dump: NCCL's own log."""
    return ("for NCCL's own account of it, run again with NCCL_DEBUG=INFO (and NCCL_DEBUG_SUBSYS=INIT,NET "
            "when ranks cannot connect)")


def peak_memory(device: torch.device) -> dict[str, float]:
    """What summary.json reports of a rank's device memory: on CUDA the most the caching allocator held for
    tensors at once (``torch.cuda.max_memory_allocated``, the figure a model's fit is judged by; read from the
    allocator's counters, no wait for the device); nothing on the CPU, which keeps no such count."""
    if device.type != "cuda":
        return {}
    return {"peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)}
