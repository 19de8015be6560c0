"""The optimizer's state in a checkpoint, keyed by the names of the parameters it belongs to.

``optimizer.state_dict()`` keys each parameter's state (AdamW's moments, SGD's momentum) by the parameter's
position in the optimizer: a refactor that reorders two parameters of one shape would silently give each the
other's moments on resume. Saved by name (``{"state": {"fc.weight": {...}}, "param_groups": [{..., "params":
["fc.weight", ...]}]}``, the layout of torch.distributed.checkpoint.state_dict.get_optimizer_state_dict), a
renamed or missing parameter is found and named instead, and the sharded checkpoint's keys read as names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["by_index", "by_name", "index_to_name", "parameter_names"]


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in its order (a tied parameter: its first name)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    ordered = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    missing = [index for index, parameter in enumerate(ordered) if id(parameter) not in names]
    if missing:
        raise ValueError(f"the optimizer holds {len(missing)} parameter(s) that are not the model's")
    return [names[id(parameter)] for parameter in ordered]


def by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every parameter index replaced by that parameter's name."""
    return {**state, "state": {names[index]: entry for index, entry in state["state"].items()},
            "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                             for group in state["param_groups"]]}


def by_index(saved: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A state saved by name, keyed by this optimizer's indices again (what ``load_state_dict`` takes); ValueError
    names what does not match this model's parameters."""
    index = {name: position for position, name in enumerate(names)}
    groups = saved.get("param_groups", [])
    listed = [name for group in groups for name in group.get("params", [])]
    unknown = [name for name in [*listed, *saved.get("state", {})] if name not in index]
    if unknown:
        listed_unknown = ", ".join(sorted(set(unknown))[:5])
        raise ValueError(f"the checkpoint's optimizer holds state for parameter(s) {listed_unknown}, which this model "
                         f"does not have")
    absent = [name for name in names if name not in set(listed)]
    if absent:
        raise ValueError(f"the checkpoint's optimizer has no parameter(s) {', '.join(absent[:5])} of this model")
    return {**saved, "state": {index[name]: entry for name, entry in saved.get("state", {}).items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]} for group in groups]}


def index_to_name(saved: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An older checkpoint's state, saved by index (its optimizer's order, which this run's matches: the same
    model builds the same order), by name."""
    if len(names) != sum(len(group.get("params", [])) for group in saved.get("param_groups", [])):
        raise ValueError(f"the checkpoint's optimizer holds a different number of parameters than this model's "
                         f"{len(names)}")
    strays = [key for key in saved.get("state", {}) if not (isinstance(key, int) and 0 <= key < len(names))]
    if strays:
        raise ValueError(f"the checkpoint's optimizer holds state for parameter index(es) {strays[:5]}, which this "
                         f"model does not have")
    return by_name(saved, names)
