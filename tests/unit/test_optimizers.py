"""The optimizers' state after a load: laid out like its parameters, whatever layout it was saved in."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trainer.config import OptimConfig
from trainer.optimizers import build_optimizer, keep_refused_kernels_off


def conv_weight(memory_format: torch.memory_format, seed: int = 0) -> nn.Parameter:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(8, 4, 3, 3, generator=generator)
    return nn.Parameter(weight.contiguous(memory_format=memory_format))


def gradient(step: int) -> torch.Tensor:
    return torch.randn(8, 4, 3, 3, generator=torch.Generator().manual_seed(100 + step))


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize(("saved", "loaded"), [(torch.channels_last, torch.contiguous_format),
                                               (torch.contiguous_format, torch.channels_last)])
def test_state_saved_in_another_layout_is_laid_out_like_its_parameter_and_updates_alike(name, saved, loaded):
    config = OptimConfig(optimizer=name, momentum=0.9)
    original = conv_weight(saved)
    optimizer = build_optimizer(config, [original], 1e-2)
    assert optimizer.param_groups[0]["fused"]  # the kernel that miscomputes mixed layouts
    for step in range(3):
        original.grad = gradient(step).contiguous(memory_format=saved)
        optimizer.step()
    state = copy.deepcopy(optimizer.state_dict())
    restored = nn.Parameter(original.detach().clone().contiguous(memory_format=loaded))
    resumed = build_optimizer(config, [restored], 1e-2)
    resumed.load_state_dict(state)
    for key, value in resumed.state[restored].items():
        if value.dim() == 4:  # the moments (AdamW) or the momentum buffer (SGD): same values, new layout
            assert value.stride() == restored.stride() and torch.equal(value, state["state"][0][key]), key
    for step in range(3, 6):
        original.grad = gradient(step).contiguous(memory_format=saved)
        restored.grad = gradient(step).contiguous(memory_format=loaded)
        optimizer.step()
        resumed.step()
    assert torch.equal(restored.detach(), original.detach())


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_resume_keeps_the_checkpoints_fused_kernel_unless_this_run_refused_it(name):
    """--no-fused-optimizer builds with fused=None: a fused checkpoint goes on fused (bitwise like before). A group
    built with fused=False (SGD on sharded parameters, whose fused kernel torch cannot run) stays unfused."""
    saved_from = build_optimizer(OptimConfig(optimizer=name), [nn.Parameter(torch.ones(3))], 1e-2)
    assert saved_from.param_groups[0]["fused"]
    saved = copy.deepcopy(saved_from.state_dict())
    unchosen = build_optimizer(OptimConfig(optimizer=name, fused_optimizer=False), [nn.Parameter(torch.ones(3))], 1e-2)
    assert unchosen.param_groups[0]["fused"] is None
    unchosen.load_state_dict(saved)
    assert unchosen.param_groups[0]["fused"] is True
    refused = torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=1e-2, fused=False)
    refused.register_load_state_dict_pre_hook(keep_refused_kernels_off)
    refused.load_state_dict(saved)
    assert refused.param_groups[0]["fused"] is False
    assert saved["param_groups"][0]["fused"] is True  # the checkpoint's own dict is left as it was
