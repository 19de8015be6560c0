"""The optimizers --optimizer names, each built from the config's optimizer section."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.registry import Registry

if TYPE_CHECKING:  # the config refers to this registry for its choices
    from trainer.config import OptimConfig

Builder = Callable[[Iterable[nn.Parameter], float, "OptimConfig"], torch.optim.Optimizer]
OPTIMIZERS: Registry[Builder] = Registry("optimizer", "--optimizer")

OPTIMIZERS.add("adamw", lambda params, lr, config: torch.optim.AdamW(params, lr=lr, weight_decay=config.weight_decay),
               "AdamW (decoupled weight decay)")
OPTIMIZERS.add("sgd", lambda params, lr, config: torch.optim.SGD(params, lr=lr, momentum=config.momentum,
                                                                  weight_decay=config.weight_decay),
               "SGD with momentum")


def build_optimizer(config: OptimConfig, params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return OPTIMIZERS.get(config.optimizer)(params, lr, config)
