"""The optimizers --optimizer names, each built from the config's optimizer section."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.config import OptimConfig
from trainer.seams import OPTIMIZERS

Builder = Callable[[Iterable[nn.Parameter], float, OptimConfig], torch.optim.Optimizer]

# Devices with fused AdamW and SGD kernels in PyTorch.
FUSED_DEVICES = ("cpu", "cuda")


def fused(params: list[nn.Parameter], config: OptimConfig) -> bool:
    """Whether PyTorch's fused kernel can run this update: one kernel for all parameters, and no read of
    the step count into Python (the for-each and per-tensor AdamW read it every step, a device wait on a
    GPU when it lives there; the fused kernel also lets fp16's grad scaler skip its per-step read of
    the inf check). On 2 CPU cores, 1M parameters: AdamW 0.5 ms a step instead of 3.5 ms.

    Its arithmetic differs in the last bits from the other kernels': the optimizer's state records which ran
    (its param groups' ``fused``), and a resume goes on with the checkpoint's, so it stays bitwise exact."""
    supported = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
    return config.fused_optimizer and bool(params) and supported


def _adamw(params: list[nn.Parameter], lr: float, config: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=config.weight_decay, fused=fused(params, config) or None)


def _sgd(params: list[nn.Parameter], lr: float, config: OptimConfig) -> torch.optim.Optimizer:
    # torch has no sharding rule for fused SGD's kernel (aten._fused_sgd_): on sharded parameters (--sync fsdp) it
    # runs for-each. False, not None: torch's default would pick the fused kernel by itself.
    sharded = any(isinstance(p, DTensor) for p in params)
    return torch.optim.SGD(params, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay,
                           fused=False if sharded else fused(params, config) or None)


OPTIMIZERS.add("adamw", _adamw, "AdamW (decoupled weight decay), fused where PyTorch has the kernel")
OPTIMIZERS.add("sgd", _sgd, "SGD with momentum, fused where PyTorch has the kernel")


def build_optimizer(config: OptimConfig, params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    optimizer = OPTIMIZERS.get(config.optimizer)(list(params), lr, config)
    optimizer.register_load_state_dict_pre_hook(keep_refused_kernels_off)
    optimizer.register_load_state_dict_post_hook(lay_out_state_like_parameters)
    return optimizer


def keep_refused_kernels_off(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """A resume goes on with the kernel its checkpoint was written with, except where this run's optimizer was
    built with the fused kernel refused (``fused=False``: SGD on sharded parameters): a DDP checkpoint of fused
    SGD resumed under --sync fsdp runs for-each. A group built with ``fused=None`` (no choice made, as
    --no-fused-optimizer leaves it) takes the checkpoint's."""
    groups = [{**group, "fused": False} if group.get("fused") and now.get("fused") is False else group
              for group, now in zip(saved.get("param_groups", []), optimizer.param_groups, strict=False)]
    return {**saved, "param_groups": groups}


def lay_out_state_like_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Give each per-parameter state tensor (AdamW's moments, SGD's momentum) its parameter's memory layout.

    ``load_state_dict`` keeps the strides the state was saved with; a checkpoint written from channels-last
    parameters and loaded into contiguous ones (or the reverse: another --channels-last, a GPU checkpoint
    resumed on CPU) would leave them differing. The fused kernels assume one layout for all their operands:
    on CPU they then compute a wrong update, silently; on CUDA they refuse with an error. Values are kept,
    only their order in memory changes."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter)
            if not state:
                continue
            for key, value in state.items():
                if (isinstance(value, torch.Tensor) and value.shape == parameter.shape and value.dim() > 1
                        and value.stride() != parameter.stride()):
                    state[key] = torch.empty_like(parameter, dtype=value.dtype).copy_(value)
