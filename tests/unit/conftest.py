"""What the unit tests share: a process group of one process (world size 1, gloo on the CPU), per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from trainer.config import DistConfig
from trainer.distributed import Runtime, destroy_process_group, init_process_group
from trainer.launchers import identity_from_env


@pytest.fixture(scope="module")
def runtime() -> Iterator[Runtime]:
    runtime = init_process_group(DistConfig(), identity_from_env({}), torch.device("cpu"))
    yield runtime
    destroy_process_group()
