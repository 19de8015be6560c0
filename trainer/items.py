"""What a task's dataset items must be, and what is wrong with a batch whose items are not that.

An item is an ``(inputs, targets)`` pair; each side a tensor, an array, a number, or a list, tuple or
dict of them; every item of a batch laid out alike (torch's default_collate stacks them). When items
do not form a batch, the message names the item's index in the dataset and how it differs from the
others of its batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor
from torch.utils.data import default_collate

from trainer.errors import TaskError, described


class Fetched(list):  # type: ignore[type-arg]
    """The items of one batch, with their dataset indices: what trainer.sampler.SeededItems returns."""

    def __init__(self, items: list[Any], indices: list[int]) -> None:
        super().__init__(items)
        self.indices = indices


def checked_collate(collate_fn: Callable[[Any], Any] | None, where: str) -> Callable[[Any], Any]:
    """collate_fn (default: torch's default_collate), with a failure explained by its items' indices.

    Module-level state only, so that DataLoader workers can pickle it.
    """
    return _CheckedCollate(collate_fn or default_collate, where, custom=collate_fn is not None)


class _CheckedCollate:
    def __init__(self, collate_fn: Callable[[Any], Any], where: str, custom: bool) -> None:
        self.collate_fn = collate_fn
        self.where = where
        self.custom = custom

    def __call__(self, fetched: Any) -> Any:
        items = list(fetched) if isinstance(fetched, Fetched) else fetched
        try:
            return self.collate_fn(items)
        except Exception as error:  # the items of a user's dataset, or a user's collate_fn
            if isinstance(fetched, Fetched) and not self.custom:
                check_items(self.where, items, fetched.indices)
            raise TaskError(f"{self.where}: items {_indices(fetched)} do not form a batch ({described(error)})"
                            ) from None


def _indices(fetched: Any) -> str:
    indices = fetched.indices if isinstance(fetched, Fetched) else []
    return ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "") if indices else "of a batch"


def check_items(where: str, items: Any, indices: list[int]) -> None:
    """Each item an (inputs, targets) pair of tensors (or nested containers), all of one layout."""
    if not isinstance(items, list):
        return  # a dataset that returns whole batches (__getitems__) has its own layout
    layouts = []
    for item, index in zip(items, indices, strict=True):
        if not (isinstance(item, list | tuple) and len(item) == 2):
            raise TaskError(f"{where}: item {index} is a {type(item).__name__}; each item must be an "
                            f"(inputs, targets) pair")
        layouts.append(_layout(item, f"item {index}"))
    common = Counter(layouts).most_common(1)[0][0]
    for layout, index in zip(layouts, indices, strict=True):
        if layout != common:
            others = sum(1 for other in layouts if other == common)
            raise TaskError(f"{where}: item {index} has {_describe(layout)} but {others} other item(s) of its batch "
                            f"have {_describe(common)}; items of a batch must match (or give TaskData a collate_fn)")


def _layout(value: Any, where: str) -> Any:
    if isinstance(value, Tensor):
        return ("tensor", str(value.dtype).removeprefix("torch."), tuple(value.shape))
    if isinstance(value, Mapping):
        return ("dict", tuple(sorted((str(key), _layout(item, where)) for key, item in value.items())))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_layout(item, where) for item in value))
    if isinstance(value, int | float | bool):
        return (type(value).__name__,)
    if hasattr(value, "__array__"):
        return ("array", str(getattr(value, "dtype", "")), tuple(getattr(value, "shape", ())))
    raise TaskError(f"{where} holds a {type(value).__name__}; items may hold tensors, arrays, numbers and lists, "
                    f"tuples or dicts of them")


def _describe(layout: Any) -> str:
    kind = layout[0]
    if kind in ("tensor", "array"):
        return f"a {layout[1]} {kind} of shape {list(layout[2])}"
    if kind == "dict":
        return "{" + ", ".join(f"{key}: {_describe(inner)}" for key, inner in layout[1]) + "}"
    if kind in ("list", "tuple"):
        return "(" + ", ".join(_describe(inner) for inner in layout[1]) + ")"
    return f"a {kind}"
