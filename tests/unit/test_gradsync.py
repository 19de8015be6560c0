"""GradSync.prime leaves no trace but DDP's fixed buckets: parameters, buffers, random state and gradients are
as before. (That it makes a resumed run exact is proven with three ranks in tests/integration/test_resume.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.config import DistConfig
from trainer.distributed import Runtime, destroy_process_group, init_process_group
from trainer.gradsync import DDPSync
from trainer.launchers import identity_from_env
from trainer.rng import capture_rng


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    runtime = init_process_group(DistConfig(), identity_from_env({}), torch.device("cpu"))
    yield runtime
    destroy_process_group()


def test_priming_ddp_changes_no_parameter_buffer_generator_or_gradient(runtime):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten(), nn.Linear(144, 3))
    ddp = DistributedDataParallel(model)
    inputs, targets = torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1])
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    generators = capture_rng()
    calls = []

    def first_loss() -> torch.Tensor:
        calls.append(1)
        return nn.functional.cross_entropy(ddp(inputs), targets)

    DDPSync(runtime).prime(ddp, first_loss)
    assert calls == [1], "one forward of the first batch"
    after = model.state_dict()
    assert after["1.num_batches_tracked"] == 0, "BatchNorm's statistics were put back"
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    assert torch.equal(torch.get_rng_state(), generators["torch"]), "dropout's draws were put back"
    assert all(parameter.grad is None for parameter in model.parameters())


def test_priming_a_plain_model_runs_nothing(runtime):
    DDPSync(runtime).prime(nn.Linear(2, 2), lambda: pytest.fail("a model without DDP needs no priming"))
