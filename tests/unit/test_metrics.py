"""The built-in metrics compute what their names say, from states the trainer can reduce across ranks."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.metrics import Accuracy, Mean, MeanAbsoluteError, Metric, RootMeanSquaredError


def test_accuracy_mae_rmse_and_mean_over_two_batches():
    outputs = [torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([[0.3, 0.7]])]
    labels = [torch.tensor([1, 1]), torch.tensor([1])]
    accuracy = Accuracy()
    for output, label in zip(outputs, labels, strict=True):
        accuracy.update(output, label)
    assert accuracy.compute().item() == pytest.approx(2 / 3)
    mae, rmse = MeanAbsoluteError(), RootMeanSquaredError()
    for metric in (mae, rmse):
        metric.update(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]))
        metric.update(torch.tensor([[2.0]]), torch.tensor([[0.0]]))
    assert mae.compute().item() == pytest.approx(5 / 3)
    assert rmse.compute().item() == pytest.approx(math.sqrt(9 / 3))
    mean = Mean()
    mean.update(torch.tensor(2.0), 3)  # a batch of 3 with mean 2, then one of 1 with mean 6
    mean.update(torch.tensor(6.0), 1)
    assert mean.compute().item() == pytest.approx(3.0)


def test_states_are_float64_tensors_with_a_reduction_and_reset_to_their_start():
    metric = MeanAbsoluteError()
    assert {name: (value.dtype, metric.reductions[name]) for name, value in metric.state.items()} == {
        "total": (torch.float64, "sum"), "count": (torch.float64, "sum")}
    metric.update(torch.ones(3), torch.zeros(3))
    metric.reset()
    assert metric.state["count"].item() == 0


def test_a_state_with_an_unknown_reduction_is_refused():
    class Median(Metric):
        def update(self, outputs, targets): ...

        def compute(self):
            return 0.0

    with pytest.raises(ValueError, match="reduce must be one of sum, max, min, got 'median'"):
        Median().add_state("values", 0.0, reduce="median")
