"""Sharded tensors in a checkpoint's parts: markers in place of the tensors, and fitting what was saved to what
this run holds.

A sharded checkpoint's state file holds, in place of each tensor, a marker ``{"__shard__": key, "shape",
"dtype"}``; the tensors lie elsewhere: in format 5, DCP's files (trainer.checkpoint.dcp_reader, the key a DCP key);
in format 4, the last release's, each rank's rows in its own ``shards-RRRRR.pt`` with a ``shards`` table saying
which file holds which rows (``ShardSource`` here reads them; format 4 is read, no longer written).

A resume fits what was saved to what this run holds: a sharded tensor gets exactly its rows, whatever world size
wrote them; a plain one gets the whole tensor. So a checkpoint written at 2 ranks loads at 3 or at 1, and a
checkpoint of a DDP run (whole tensors in the state file) loads into a sharded run and back: the parts have the
same layout, only where the tensors lie differs.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainer.sharding import local_rows

__all__ = ["MARK", "ShardSource", "fit", "fit_all", "has_sharded", "is_marker", "marker_for", "markers",
           "replace_tensors"]

MARK = "__shard__"


def has_sharded(value: Any) -> bool:
    if isinstance(value, DTensor):
        return True
    if isinstance(value, dict):
        return any(has_sharded(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(has_sharded(item) for item in value)
    return False


def marker_for(place: Any, tensor: torch.Tensor) -> dict[str, Any]:
    """What a tensor leaves in the state file: where it lies (a DCP key, a path), its shape and its type."""
    return {MARK: place, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def replace_tensors(value: Any, replace: Callable[[torch.Tensor, tuple[Any, ...]], Any],
                    path: tuple[Any, ...] = ()) -> Any:
    """``value`` with each tensor in it (a DTensor too) replaced by ``replace(tensor, path)``, ``path`` the keys
    and indices that lead to it."""
    if isinstance(value, torch.Tensor):
        return replace(value, path)
    if isinstance(value, dict):
        return type(value)((key, replace_tensors(item, replace, (*path, key))) for key, item in value.items())
    if isinstance(value, list | tuple):
        return type(value)(replace_tensors(item, replace, (*path, index)) for index, item in enumerate(value))
    return value


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

    def prepare(self, wanted: Any) -> None:
        """Nothing to read ahead: each file is read when its rows are first asked for."""

    def whole(self, marker: dict[str, Any]) -> torch.Tensor:
        return self.rows(marker, 0, marker["shape"][0])

    def _file(self, filename: str) -> dict[str, torch.Tensor]:
        if filename not in self._loaded:
            self._loaded[filename] = torch.load(io.BytesIO(self._read(filename)), map_location="cpu",
                                                weights_only=True)
        return self._loaded[filename]

    def close(self) -> None:
        self._loaded.clear()


def fit(saved: Any, template: Any, source: Any) -> Any:
    """``saved`` made to match ``template`` (what this run holds at that place): a marker becomes this rank's
    rows of it (a DTensor template) or the whole tensor (a plain one); a whole tensor saved by a plain run
    becomes this rank's rows where this run shards it. ``source``: where the markers' tensors lie (ShardSource
    here, dcp_reader.DcpSource, state_file.StateFileSource: ``rows`` and ``whole``), None where there are none."""
    if is_marker(saved):
        if source is None:
            raise ValueError(f"{saved[MARK]} is sharded but the checkpoint has no shard files")
        if isinstance(template, DTensor):
            first, count = local_rows(template)
            return _as_shard(source.rows(saved, first, count), template)
        return source.whole(saved)
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


def fit_all(saved: Any, template: Any, source: Any) -> Any:
    """``fit`` for one value alone: its source first reads what it holds (trainer.checkpoint.dcp_reader reads every
    tensor in one collective pass)."""
    if source is not None:
        source.prepare(markers(saved, template))
    return fit(saved, template, source)


def markers(saved: Any, template: Any) -> list[tuple[dict[str, Any], Any]]:
    """Every marker in ``saved``, each with what this run holds at its place (None where it holds nothing)."""
    if is_marker(saved):
        return [(saved, template)]
    if isinstance(saved, dict):
        inner = template if isinstance(template, dict) else {}
        return [pair for key, value in saved.items() for pair in markers(value, inner.get(key))]
    if isinstance(saved, list | tuple):
        inner = template if isinstance(template, list | tuple) and len(template) == len(saved) else [None] * len(saved)
        return [pair for value, other in zip(saved, inner, strict=True) for pair in markers(value, other)]
    return []


def _as_shard(rows: torch.Tensor, template: DTensor) -> DTensor:
    local = template.to_local()
    return DTensor.from_local(rows.to(device=local.device, dtype=local.dtype).contiguous(), template.device_mesh,
                              template.placements, run_check=False, shape=template.shape, stride=template.stride())
