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


def by_index(saved: dict[str, Any], optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, Any]:
    """A state saved by name in the layout ``optimizer.load_state_dict`` takes: keyed by this optimizer's indices,
    each group's parameters listed in this optimizer's order (load_state_dict pairs saved and current parameters
    by position: the saved order would give one parameter another's moments after a refactor reordered them).
    ValueError names what does not match this model's parameters or groups."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        raise ValueError("the checkpoint's optimizer state does not have the layout this trainer writes")
    index = {name: position for position, name in enumerate(names)}
    groups, current = saved["param_groups"], optimizer.param_groups
    if len(groups) != len(current):
        raise ValueError(f"the checkpoint's optimizer has {len(groups)} parameter group(s), this one {len(current)}")
    listed = [name for group in groups for name in group.get("params", [])]
    unknown = sorted({name for name in [*listed, *saved.get("state", {})] if name not in index}, key=str)
    if unknown:
        raise ValueError(f"the checkpoint's optimizer holds state for parameter(s) {', '.join(map(str, unknown[:5]))}, "
                         f"which this model does not have")
    start, laid_out = 0, []
    for number, (group, now) in enumerate(zip(groups, current, strict=True)):
        mine = list(range(start, start + len(now["params"])))
        start += len(now["params"])
        if {index[name] for name in group.get("params", [])} != set(mine):
            differ = sorted({names[i] for i in mine} ^ set(group.get("params", [])))
            raise ValueError(f"parameter group {number} of the checkpoint's optimizer holds other parameters than "
                             f"this one's ({', '.join(differ[:5])})")
        laid_out.append({**group, "params": mine})
    return {**saved, "state": {index[name]: entry for name, entry in saved.get("state", {}).items()},
            "param_groups": laid_out}


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
