"""Reading what the trainer wrote, for assertions: checkpoints and summaries."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import LoadedCheckpoint, TaskRecord, TrainingPosition, TrainingState, open_storage, verify
from trainer.checkpoint.shards import fit_all
from trainer.rng import capture_rng


def wait_for_checkpoint(checkpoint_dir: Path, *processes: subprocess.Popen, timeout_s: float = 120) -> None:
    """Block until a run has committed its first checkpoint (a manifest appears) in checkpoint_dir, failing
    if one of ``processes`` ends first or none appears in time: the observable point to interrupt a run at."""
    deadline = time.monotonic() + timeout_s
    while not list(checkpoint_dir.glob("step-*/manifest.json")):
        for process in processes:
            assert process.poll() is None, f"the run ended before writing a checkpoint (exit {process.returncode})"
        assert time.monotonic() < deadline, f"no checkpoint appeared in {checkpoint_dir} within {timeout_s:g}s"
        time.sleep(0.05)


def newest_checkpoint(checkpoint_dir: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(name, manifest, state as a plain dict) of the newest valid checkpoint."""
    storage = open_storage(str(checkpoint_dir))
    names = storage.list_checkpoints()
    assert names, f"no checkpoint in {checkpoint_dir}"
    loaded = verify(storage, names[0])
    return names[0], loaded.manifest, whole(loaded)


def whole(loaded: LoadedCheckpoint) -> dict[str, Any]:
    """A checkpoint's state as a plain dict, a sharded one's tensors put together from every rank's rows."""
    source = loaded.shard_source()
    raw = loaded.state.to_dict()
    return raw if source is None else fit_all(raw, None, source)


def assert_same_tensors(left: Any, right: Any, path: str = "") -> None:
    """Bitwise equality of nested state (tensors compared with torch.equal)."""
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and left.dtype == right.dtype and torch.equal(left, right), path
    elif isinstance(left, dict):
        assert set(left) == set(right), f"{path}: keys differ"
        for key in left:
            assert_same_tensors(left[key], right[key], f"{path}/{key}")
    elif isinstance(left, list | tuple):
        assert len(left) == len(right), path
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            assert_same_tensors(a, b, f"{path}/{index}")
    else:
        assert left == right, f"{path}: {left!r} != {right!r}"


def every_file_under(*folders: Path) -> dict[str, bytes]:
    """Every file a run left under the folders, path to content (to look for what must not be written)."""
    return {str(path): path.read_bytes() for folder in folders for path in folder.rglob("*") if path.is_file()}


def summary(output_dir: Path) -> dict[str, Any]:
    return json.loads((output_dir / "summary.json").read_text())


def state_at(step: int, weight: torch.Tensor | None = None) -> TrainingState:
    """A minimal training state: one weight tensor (filled with the step), at ``step``, this rank's generators."""
    parts = {"model": {"weight": torch.full((64, 64), float(step)) if weight is None else weight}, "optimizer": {},
             "grad_scaler": {}, "position": TrainingPosition(step=step).to_dict(),
             "task": asdict(TaskRecord("test", "test", {})), "config": {}, "rng": capture_rng()}
    return TrainingState(parts, 1, {}, dict.fromkeys(parts, 1), per_rank=("rng",))
