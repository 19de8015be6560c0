"""The optimizer's state saved by parameter name: a refactor that reorders parameters of one shape keeps each
one's moments; what does not match is one line; a checkpoint without the part is refused, not upgraded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.checkpoint_reading import state_at
from trainer.build import state_parts
from trainer.checkpoint import RestoreContext
from trainer.errors import CheckpointError
from trainer.optimizer_state import by_index, by_name, parameter_names


class Two(nn.Module):
    """Two parameters of one shape, registered in the order asked for."""

    def __init__(self, order: str) -> None:
        super().__init__()
        for name in order:
            self.register_parameter(name, nn.Parameter(torch.zeros(3)))


def trained(order: str) -> tuple[Two, torch.optim.Optimizer]:
    model = Two(order)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.x.grad, model.y.grad = torch.ones(3), torch.full((3,), 2.0)
    optimizer.step()
    return model, optimizer


def test_reordered_parameters_keep_their_own_moments():
    model, optimizer = trained("xy")
    saved = by_name(optimizer.state_dict(), parameter_names(model, optimizer))
    reordered = Two("yx")
    other = torch.optim.SGD(reordered.parameters(), lr=0.1, momentum=0.9)
    other.load_state_dict(by_index(saved, other, parameter_names(reordered, other)))
    assert torch.equal(other.state[reordered.x]["momentum_buffer"], torch.ones(3))
    assert torch.equal(other.state[reordered.y]["momentum_buffer"], torch.full((3,), 2.0))


def test_parameters_in_other_groups_or_unknown_names_are_one_line():
    model, optimizer = trained("xy")
    saved = by_name(optimizer.state_dict(), parameter_names(model, optimizer))
    grouped = Two("xy")
    split = torch.optim.SGD([{"params": [grouped.x]}, {"params": [grouped.y]}], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"^the checkpoint's optimizer has 1 parameter group\(s\), this one 2$"):
        by_index(saved, split, parameter_names(grouped, split))
    saved["state"]["z"] = saved["state"].pop("y")
    with pytest.raises(ValueError, match="holds state for parameter\\(s\\) z, which this model does not have"):
        by_index(saved, optimizer, parameter_names(model, optimizer))


def test_a_checkpoint_without_the_optimizer_part_is_refused_in_one_line():
    model, optimizer = trained("xy")
    parts = state_parts(model, optimizer, torch.amp.GradScaler("cpu", enabled=False))
    state = state_at(1)
    del state.parts["optimizer"]
    with pytest.raises(CheckpointError, match="holds no part 'optimizer', and this trainer reads version 2 only"):
        parts.restore(state, RestoreContext(0, 1, 1, 0, 1, "ckpt", None))
