"""GlooSyncBatchNorm without other ranks: the conversion, evaluation, and a group of one rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.tensors import close
from tests.workers.syncbn_worker import global_batch, make_layer, run_layer
from trainer.config import DistConfig
from trainer.distributed import process_group
from trainer.launchers import identity_from_env
from trainer.syncbn import GlooSyncBatchNorm, convert_sync_batchnorm

CPU = torch.device("cpu")


# --- conversion -------------------------------------------------------------------------------------------


def test_conversion_keeps_configuration_parameters_and_statistics() -> None:
    batchnorm = nn.BatchNorm2d(5, eps=1e-3, momentum=0.25)
    with torch.no_grad():
        batchnorm.weight.uniform_(0.5, 1.5)
        batchnorm.bias.normal_()
        batchnorm.running_mean.normal_()
        batchnorm.running_var.uniform_(0.5, 2.0)
    batchnorm.num_batches_tracked.fill_(7)

    sync = convert_sync_batchnorm(batchnorm, CPU)

    assert isinstance(sync, GlooSyncBatchNorm)
    assert (sync.num_features, sync.eps, sync.momentum, sync.affine, sync.track_running_stats) == (5, 1e-3, 0.25,
                                                                                                   True, True)
    # The same tensors: an optimizer built before the conversion still updates the layer.
    assert sync.weight is batchnorm.weight and sync.bias is batchnorm.bias
    assert sync.running_mean is batchnorm.running_mean and sync.running_var is batchnorm.running_var
    assert sync.num_batches_tracked.item() == 7


def test_conversion_keeps_cumulative_average_and_layers_without_affine_bias_or_running_stats() -> None:
    cumulative = convert_sync_batchnorm(nn.BatchNorm1d(3, momentum=None), CPU)
    no_affine = convert_sync_batchnorm(nn.BatchNorm1d(3, affine=False), CPU)
    no_bias = convert_sync_batchnorm(nn.BatchNorm1d(3, bias=False), CPU)
    untracked = convert_sync_batchnorm(nn.BatchNorm1d(3, track_running_stats=False), CPU)

    assert cumulative.momentum is None
    assert no_affine.weight is None and no_affine.bias is None and not no_affine.affine
    assert no_bias.weight is not None and no_bias.bias is None
    assert untracked.running_mean is None and untracked.num_batches_tracked is None
    assert not untracked.track_running_stats


def test_conversion_replaces_nested_layers_of_every_dimensionality_and_keeps_the_rest() -> None:
    conv, linear = nn.Conv2d(1, 2, 3), nn.Linear(2, 2)
    model = nn.Sequential(conv, nn.BatchNorm2d(2), nn.Sequential(linear, nn.BatchNorm1d(2)),
                          nn.ModuleDict({"volume": nn.BatchNorm3d(2), "sync": nn.SyncBatchNorm(2)}))

    converted = convert_sync_batchnorm(model, CPU)

    assert converted is model
    assert isinstance(model[1], GlooSyncBatchNorm)
    assert isinstance(model[2][1], GlooSyncBatchNorm)
    assert isinstance(model[3]["volume"], GlooSyncBatchNorm)
    assert isinstance(model[3]["sync"], GlooSyncBatchNorm), "PyTorch's SyncBatchNorm refuses CPU: replace it too"
    assert model[0] is conv and model[2][0] is linear


def test_conversion_keeps_evaluation_mode() -> None:
    model = nn.Sequential(nn.BatchNorm1d(2)).eval()

    convert_sync_batchnorm(model, CPU)

    assert not model[0].training


def test_conversion_for_cuda_uses_pytorchs_syncbatchnorm() -> None:
    converted = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(2)), torch.device("cuda", 0))

    assert type(converted[0]) is nn.SyncBatchNorm


def test_uninitialised_lazy_batchnorm_is_refused_with_a_fix() -> None:
    with pytest.raises(ValueError, match="before its first forward pass"):
        convert_sync_batchnorm(nn.LazyBatchNorm1d(), CPU)


# --- without other ranks ----------------------------------------------------------------------------------


def test_evaluation_uses_running_statistics_without_a_process_group() -> None:
    batchnorm = make_layer("bn2d")
    with torch.no_grad():
        batchnorm.running_mean.normal_()
        batchnorm.running_var.uniform_(0.5, 2.0)
    sync = convert_sync_batchnorm(make_layer("bn2d"), CPU)
    sync.load_state_dict(batchnorm.state_dict())
    inputs, _ = global_batch("bn2d", 0, 6)

    close(sync.eval()(inputs), batchnorm.eval()(inputs))


def test_group_of_one_rank_trains_like_plain_batchnorm() -> None:
    reference = make_layer("bn2d")
    sync = convert_sync_batchnorm(make_layer("bn2d"), CPU)
    inputs, loss_weights = global_batch("bn2d", 0, 6)

    with process_group(DistConfig(device="cpu"), identity_from_env({}), CPU):
        result = run_layer(sync, inputs, loss_weights, torch.float32)
    expected = run_layer(reference, inputs, loss_weights, torch.float32)

    for key, value in expected.items():
        close(result[key], value)
    close(sync.running_var, reference.running_var)


