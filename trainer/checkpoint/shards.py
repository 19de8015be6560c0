"""Sharded tensors in a checkpoint: each rank writes the rows it holds, and a resume reads the rows it needs.

Under --sync fsdp/hsdp the model's parameters and the optimizer's state are DTensors sharded on their first
dimension. A save replaces each by a marker in the parts (``{"__shard__": path, "shape", "dtype"}``) and each
rank writes its rows of them to its own file, ``shards-RRRRR.pt`` (plain tensors: loadable with
``weights_only=True``); the checkpoint's ``shards`` entry says which rows of which tensor each file holds. One
replica writes under HSDP (its copies elsewhere are the same).

A resume fits what was saved to what this run holds: a sharded tensor gets exactly its rows, read from the
files that hold them, whatever the world size that wrote them; a plain one gets the whole tensor. So a
checkpoint written at 2 ranks loads at 3 or at 1, and a checkpoint of a DDP run (whole tensors in the state
file) loads into a sharded run and back: the parts have the same layout, only where the tensors lie differs.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from trainer.sharding import local_rows

__all__ = ["ShardSource", "SplitState", "fit", "has_sharded", "shard_file", "split"]

MARK = "__shard__"


def shard_file(rank: int) -> str:
    return f"shards-{rank:05d}.pt"


def has_sharded(value: Any) -> bool:
    if isinstance(value, DTensor):
        return True
    if isinstance(value, dict):
        return any(has_sharded(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(has_sharded(item) for item in value)
    return False


@dataclass
class SplitState:
    """A rank's parts with their sharded tensors taken out."""

    plain: Any  # the parts, each sharded tensor replaced by its marker
    local: dict[str, torch.Tensor] = field(default_factory=dict)  # the rows this rank writes, by path
    rows: dict[str, list[int]] = field(default_factory=dict)  # path -> [first row, row count]


def split(value: Any, path: str = "", into: SplitState | None = None) -> SplitState:
    state = into or SplitState(None)
    if isinstance(value, DTensor):
        first, count = local_rows(value)
        # Under HSDP the replicas hold the same rows: the first replica writes them.
        coordinate = value.device_mesh.get_coordinate() or []
        if all(index == 0 for index, placement in zip(coordinate, value.placements, strict=True)
               if isinstance(placement, Replicate)):
            state.local[path] = value.to_local().detach()
            state.rows[path] = [first, count]
        plain: Any = {MARK: path, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    elif isinstance(value, dict):
        plain = type(value)((key, split(item, f"{path}/{key}", state).plain) for key, item in value.items())
    elif isinstance(value, list | tuple):
        plain = type(value)(split(item, f"{path}/{index}", state).plain for index, item in enumerate(value))
    else:
        plain = value
    state.plain = plain
    return state


def is_marker(value: Any) -> bool:
    return isinstance(value, dict) and MARK in value


class ShardSource:
    """The rows of a checkpoint's sharded tensors, read from its shard files on demand (each file once)."""

    def __init__(self, layout: dict[str, Any], read: Callable[[str], bytes]) -> None:
        self.files: dict[str, dict[str, list[int]]] = layout["files"]
        self._read = read  # filename -> its bytes, checked against the manifest
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}

    def rows(self, marker: dict[str, Any], first: int, count: int) -> torch.Tensor:
        """Rows [first, first + count) of the saved tensor, gathered from every file that holds some."""
        path, shape = marker[MARK], marker["shape"]
        result = torch.empty([count, *shape[1:]], dtype=getattr(torch, marker["dtype"]))
        covered = 0
        for filename, held in self.files.items():
            if path not in held:
                continue
            start, length = held[path]
            low, high = max(first, start), min(first + count, start + length)
            if low >= high:
                continue
            result[low - first:high - first] = self._file(filename)[path][low - start:high - start]
            covered += high - low
        if covered != count:
            raise ValueError(f"the checkpoint's shard files hold {covered} of rows {first}..{first + count} of "
                             f"{path} (a shard file is missing from its layout)")
        return result

    def _file(self, filename: str) -> dict[str, torch.Tensor]:
        if filename not in self._loaded:
            self._loaded[filename] = torch.load(io.BytesIO(self._read(filename)), map_location="cpu",
                                                weights_only=True)
        return self._loaded[filename]

    def close(self) -> None:
        self._loaded.clear()


def fit(saved: Any, template: Any, source: ShardSource | None) -> Any:
    """``saved`` made to match ``template`` (what this run holds at that place): a marker becomes this rank's
    rows of it (a DTensor template) or the whole tensor (a plain one); a whole tensor saved by a plain run
    becomes this rank's rows where this run shards it."""
    if is_marker(saved):
        if source is None:
            raise ValueError(f"{saved[MARK]} is sharded but the checkpoint has no shard files")
        if isinstance(template, DTensor):
            first, count = local_rows(template)
            return _as_shard(source.rows(saved, first, count), template)
        return source.rows(saved, 0, saved["shape"][0])
    if isinstance(saved, torch.Tensor) and isinstance(template, DTensor):
        if tuple(saved.shape) != tuple(template.shape):
            raise ValueError(f"a tensor of shape {list(saved.shape)} where the model has {list(template.shape)}")
        first, count = local_rows(template)
        return _as_shard(saved[first:first + count], template)
    if isinstance(saved, dict):
        inner = template if isinstance(template, dict) else {}
        return type(saved)((key, fit(value, inner.get(key), source)) for key, value in saved.items())
    if isinstance(saved, list | tuple):
        inner = template if isinstance(template, list | tuple) and len(template) == len(saved) else [None] * len(saved)
        return type(saved)(fit(value, other, source) for value, other in zip(saved, inner, strict=True))
    return saved


def _as_shard(rows: torch.Tensor, template: DTensor) -> DTensor:
    local = template.to_local()
    return DTensor.from_local(rows.to(device=local.device, dtype=local.dtype).contiguous(), template.device_mesh,
                              template.placements, run_check=False, shape=template.shape, stride=template.stride())
