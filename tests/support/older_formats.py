"""Checkpoints in the layouts earlier releases wrote, made on this machine from one the trainer just wrote: the
values are this machine's, only the layout is the old one (their writers are gone from the trainer).

Format 4 (the release before DCP): each sharded tensor's rows in ``shards-RRRRR.pt`` per rank, split as FSDP2
splits them (``ceil(rows / ranks)`` each), a marker ``{"__shard__": path, "shape", "dtype"}`` in its place in
``state.pt`` and the ``shards`` table saying which file holds which rows; plain tensors (buffers, step counts)
stay in ``state.pt``; the optimizer part at version 1, keyed by parameter index.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import torch

from tests.support.checkpoint_reading import whole
from trainer.checkpoint import open_storage, verify
from trainer.checkpoint.storage import crc32_hex


def write_format_4(source: Path, target: Path, ranks: int) -> None:
    """``source`` (a format 5 checkpoint folder) rewritten as format 4 in folder ``target``, as ``ranks`` wrote it."""
    loaded = verify(open_storage(str(source.parent)), source.name)
    state = whole(loaded)
    names = [name for group in state["optimizer"]["param_groups"] for name in group["params"]]
    optimizer = state["optimizer"]
    by_index = {names.index(name): entry for name, entry in optimizer["state"].items()}
    state["optimizer"] = {**optimizer, "state": by_index,
                          "param_groups": [{**group, "params": [names.index(name) for name in group["params"]]}
                                           for group in optimizer["param_groups"]]}
    state["part_versions"] = {**state["part_versions"], "optimizer": 1}
    shapes = {name: list(state["model"][name].shape) for name in names}
    files: dict[str, dict[str, torch.Tensor]] = {f"shards-{rank:05d}.pt": {} for rank in range(ranks)}
    table: dict[str, dict[str, list[int]]] = {name: {} for name in files}

    def shard(value: torch.Tensor, path: str) -> dict[str, Any]:
        per_rank = math.ceil(value.shape[0] / ranks)
        for rank, filename in enumerate(files):
            first = min(rank * per_rank, value.shape[0])
            count = max(0, min(per_rank, value.shape[0] - first))
            if count:
                files[filename][path] = value[first:first + count].clone()
                table[filename][path] = [first, count]
        return {"__shard__": path, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}

    state["model"] = {key: shard(value, f"/model/{key}") if key in shapes else value
                      for key, value in state["model"].items()}
    for index, entry in state["optimizer"]["state"].items():
        for key, value in entry.items():
            if list(getattr(value, "shape", [])) == shapes[names[index]]:
                entry[key] = shard(value, f"/optimizer/state/{index}/{key}")
    state["shards"] = {"files": {name: rows for name, rows in table.items() if rows}}
    target.mkdir(parents=True)
    described = {}
    for filename, content in [("state.pt", state), *((name, rows) for name, rows in files.items() if rows)]:
        buffer = io.BytesIO()
        torch.save(content, buffer)
        (target / filename).write_bytes(buffer.getvalue())
        described[filename] = {"bytes": len(buffer.getvalue()), "crc32": crc32_hex(buffer.getvalue())}
    manifest = {**{key: value for key, value in loaded.manifest.items() if key != "files"}, "format": 4,
                "files": described}
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2))


def with_whole_item_checksums(folder: Path) -> None:
    """A format 5 checkpoint folder's items.json rewritten as it was before 2026-11-26: one CRC-32 of each whole
    item (each is read whole and unpickled), its manifest entry to match."""
    items = json.loads((folder / "items.json").read_text())
    old = {}
    for filename, entries in items.items():
        data = (folder / filename).read_bytes()
        ends = sorted(int(offset) for offset in entries)[1:] + [len(data)]
        old[filename] = {str(offset): crc32_hex(data[offset:end])
                         for offset, end in zip(sorted(int(offset) for offset in entries), ends, strict=True)}
    content = json.dumps(old, sort_keys=True).encode()
    (folder / "items.json").write_bytes(content)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["items.json"] = {"bytes": len(content), "crc32": crc32_hex(content)}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
