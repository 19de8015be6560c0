"""Synchronised BatchNorm on every backend: PyTorch's on CUDA, ours on CPU over gloo.

PyTorch's ``nn.SyncBatchNorm`` accepts only accelerator tensors, and DDP refuses a CPU module that
holds one ("SyncBatchNorm layers only work with GPU modules"). ``GlooSyncBatchNorm`` normalises
with the statistics of the whole group's batch, so a layer on N ranks with B samples each behaves
like ``nn.BatchNorm`` on one batch of N x B, on any backend.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

__all__ = ["GlooSyncBatchNorm", "convert_sync_batchnorm"]


def convert_sync_batchnorm(module: nn.Module, device: torch.device,
                           process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every BatchNorm layer by one synchronised across ``process_group`` (default: all ranks).

    The new layers share the old ones' parameters and buffers, as PyTorch's conversion does. If
    ``module`` itself is a BatchNorm layer the replacement is returned; otherwise ``module``, changed
    in place.
    """
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    return _convert(module, process_group)


def _convert(module: nn.Module, process_group: dist.ProcessGroup | None) -> nn.Module:
    converted = module
    # nn.SyncBatchNorm is a _BatchNorm too: on CPU it must be replaced like the others.
    if isinstance(module, _BatchNorm) and not isinstance(module, GlooSyncBatchNorm):
        converted = GlooSyncBatchNorm.from_batchnorm(module, process_group)
    for name, child in module.named_children():
        converted.add_module(name, _convert(child, process_group))
    return converted


class GlooSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the whole group's batch (any backend, any input rank >= 2).

    Training forward costs one all-reduce, backward one more (none when the input needs no gradient).
    Evaluation with running statistics, and a group of one rank, issue no collective: ranks may
    evaluate different numbers of batches. Gradients of weight and bias are this rank's share only;
    DDP (or any gradient all-reduce) sums them across ranks, as with PyTorch's SyncBatchNorm.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None, dtype: torch.dtype | None = None, *, bias: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype,
                         bias=bias)
        self.process_group = process_group

    @classmethod
    def from_batchnorm(cls, batchnorm: _BatchNorm,
                       process_group: dist.ProcessGroup | None = None) -> GlooSyncBatchNorm:
        if isinstance(batchnorm, LazyModuleMixin) and batchnorm.has_uninitialized_params():
            raise ValueError(f"cannot synchronise {type(batchnorm).__name__} before its first forward pass: run one "
                             f"batch through the model (or use a BatchNorm with num_features) before converting")
        sync = cls(batchnorm.num_features, batchnorm.eps, batchnorm.momentum, batchnorm.affine,
                   batchnorm.track_running_stats, process_group, bias=batchnorm.bias is not None)
        # The same tensors, not copies: an optimizer or EMA built before the conversion keeps working.
        sync.weight = batchnorm.weight
        sync.bias = batchnorm.bias
        sync.running_mean = batchnorm.running_mean
        sync.running_var = batchnorm.running_var
        sync.num_batches_tracked = batchnorm.num_batches_tracked
        sync.train(batchnorm.training)
        return sync

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {input.dim()}D input")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        factor = self._running_average_factor()
        # As nn.BatchNorm: batch statistics in training, and in evaluation when no running ones exist.
        use_batch_stats = self.training or self.running_mean is None
        keep_running = not self.training or self.track_running_stats
        running_mean = self.running_mean if keep_running else None
        running_var = self.running_var if keep_running else None
        group = self._sync_group() if self.training else None
        if group is None:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, use_batch_stats, factor,
                                self.eps)
        return _sync_batch_norm(input, self.weight, self.bias, running_mean, running_var, self.eps, factor, group)

    def _running_average_factor(self) -> float:
        """Counts the batch and gives the weight of its statistics in the running ones (nn.BatchNorm's rule)."""
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                return 1.0 / float(self.num_batches_tracked)
        return 0.0 if self.momentum is None else self.momentum

    def _sync_group(self) -> dist.ProcessGroup | None:
        """The group to synchronise over, or None when there is nothing to synchronise with."""
        if not dist.is_available() or not dist.is_initialized():
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None


@torch.compiler.disable
def _sync_batch_norm(input: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                     running_var: Tensor | None, eps: float, momentum: float, group: dist.ProcessGroup) -> Tensor:
    """Always eager under torch.compile: its collectives then keep their place among DDP's, in issue order."""
    return _SyncBatchNormFunction.apply(input, weight, bias, running_mean, running_var, eps, momentum, group)


def _channel_view(values: Tensor, like: Tensor) -> Tensor:
    """Per-channel values shaped to broadcast over (batch, channels, *spatial)."""
    return values.view(1, -1, *([1] * (like.dim() - 2)))


def _reduced_dims(input: Tensor) -> list[int]:
    return [0, *range(2, input.dim())]


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalisation with statistics and their gradients summed over the group."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                running_var: Tensor | None, eps: float, momentum: float, group: dist.ProcessGroup) -> Tensor:
        # bf16/fp16 inputs (autocast) get float32 statistics, as nn.BatchNorm does; float64 stays float64.
        compute = torch.promote_types(input.dtype, torch.float32)
        x = input.to(compute)
        count = input.numel() // input.size(1)

        # Ranks' batch sizes may differ, so each sends sums, not means. Sums of squares minus a squared
        # mean cancel badly when |mean| >> std, so each rank computes its mean and variance stably and
        # the sums travel in float64, which leaves ~1e-16 * (mean/std)^2 relative error in the variance.
        if count > 0:
            # batch_norm_update_stats is var_mean's result (biased variance) in BatchNorm's own
            # kernel: about 3x faster on CPU (measured in bench/, figure 6).
            local_mean, local_var = (s.double() for s in torch.batch_norm_update_stats(x, None, None, 0.0))
        else:  # a rank with an empty batch still joins the collective, contributing nothing
            local_var = local_mean = torch.zeros(input.size(1), dtype=torch.float64, device=input.device)
        totals = torch.cat([local_mean * count, (local_var + local_mean.square()) * count,
                            torch.tensor([count], dtype=torch.float64, device=input.device)])
        dist.all_reduce(totals, group=group)
        sums, sums_of_squares, total = totals.tensor_split([input.size(1), 2 * input.size(1)])
        total_count = int(total.item())
        if total_count < 2:
            # Every rank sees the same total, so every rank raises: no rank is left waiting.
            raise ValueError(f"expected more than 1 value per channel when training, got {total_count} "
                             f"across the group (input shape on this rank {list(input.shape)})")
        mean = sums / total_count
        var = (sums_of_squares / total_count - mean.square()).clamp_min(0)

        if running_mean is not None:
            running_mean.lerp_(mean.to(running_mean.dtype), momentum)
        if running_var is not None:
            # Normalisation uses the biased variance; the running estimate the unbiased one (nn.BatchNorm).
            unbiased = var * (total_count / (total_count - 1))
            running_var.lerp_(unbiased.to(running_var.dtype), momentum)

        mean = mean.to(compute)
        invstd = torch.rsqrt(var + eps).to(compute)
        # The normalisation itself as one fused kernel with the global statistics (about 10x faster on
        # CPU than the same arithmetic written out tensor by tensor).
        output = F.batch_norm(x, mean, var.to(compute), None if weight is None else weight.to(compute),
                              None if bias is None else bias.to(compute), False, 0.0, eps)
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.group = group
        ctx.total_count = total_count
        return output.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        compute = mean.dtype
        dims = _reduced_dims(input)
        grad = grad_output.to(compute)
        centred = input.to(compute) - _channel_view(mean, grad)
        sum_grad = grad.sum(dims)
        sum_grad_centred = (grad * centred).sum(dims)

        grad_input = None
        if ctx.needs_input_grad[0]:
            # The mean and variance depend on every rank's inputs, so their gradient needs every
            # rank's share of these two sums; the weight and bias gradients below stay local.
            totals = torch.cat([sum_grad, sum_grad_centred])
            dist.all_reduce(totals, group=ctx.group)
            all_sum_grad, all_sum_grad_centred = totals.tensor_split(2)
            n = ctx.total_count
            scale = invstd if weight is None else invstd * weight.to(compute)
            grad_input = (grad - _channel_view(all_sum_grad / n, grad)
                          - centred * _channel_view(invstd.square() * all_sum_grad_centred / n, grad))
            grad_input = (grad_input * _channel_view(scale, grad)).to(input.dtype)

        grad_weight = (sum_grad_centred * invstd).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_grad.to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
