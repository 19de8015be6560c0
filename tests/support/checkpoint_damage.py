"""Breaking checkpoints on purpose, in every way a crash, a bad disk or a hostile file could, and
fingerprinting a checkpoint folder to prove that nothing in it changed."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.lease import LEASE_FOLDER


class RunsCodeWhenUnpickled:
    """Unpickling it creates ``marker``: proof that a loader executed the checkpoint's code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def _edit_manifest(folder: Path, change: Any) -> None:
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _describe_state_file(manifest: dict[str, Any], data: bytes) -> None:
    manifest["files"]["state.pt"] = {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def break_checkpoint(folder: Path, defect: str, marker: Path | None = None, version: int = 0) -> None:
    state = folder / "state.pt"
    data = state.read_bytes()
    if defect == "flipped-bytes":
        middle = len(data) // 2
        state.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 16]) + data[middle + 16:])
    elif defect == "truncated":
        state.write_bytes(data[: len(data) // 2])
    elif defect == "checksum-mismatch":
        _edit_manifest(folder, lambda m: m["files"]["state.pt"].update(crc32=f"{(zlib.crc32(data) ^ 1):08x}"))
    elif defect == "size-mismatch":
        _edit_manifest(folder, lambda m: m["files"]["state.pt"].update(bytes=len(data) + 1))
    elif defect == "missing-manifest":
        (folder / "manifest.json").unlink()
    elif defect == "unparseable-manifest":
        (folder / "manifest.json").write_text('{"format": 2, "files": ')
    elif defect == "manifest-without-checksum":
        _edit_manifest(folder, lambda m: m["files"]["state.pt"].pop("crc32"))
    elif defect == "linked-state":  # the same bytes, but through a link to a file elsewhere
        elsewhere = folder.parent / f"elsewhere-{folder.name}.pt"
        state.rename(elsewhere)
        state.symlink_to(elsewhere)
    elif defect == "fifo-state":  # reading it would wait for a writer forever
        state.unlink()
        os.mkfifo(state)
    elif defect == "huge-manifest":  # still valid JSON, padded past any manifest the trainer writes
        manifest = folder / "manifest.json"
        manifest.write_text(manifest.read_text() + " " * (2 << 20))
    elif defect == "format":
        _edit_manifest(folder, lambda m: m.update(format=version))
    elif defect == "pickled-object":
        # A well-formed checkpoint (size and checksum match) whose state would run code if unpickled freely.
        assert marker is not None
        torch.save({"model": RunsCodeWhenUnpickled(marker)}, state)
        _edit_manifest(folder, lambda m: _describe_state_file(m, state.read_bytes()))
    else:
        raise ValueError(f"unknown defect {defect!r}")


def checkpoint_bytes(folder: Path) -> dict[str, bytes]:
    """Every file of the checkpoints under ``folder`` and its content (not the folder's lease, which each job
    renews and releases)."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file() and LEASE_FOLDER not in path.relative_to(folder).parts}
