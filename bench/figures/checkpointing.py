"""Figure 7: checkpoint saves against the disk's own speed, measured in one run, interleaved, median of N.

For each training state (ResNet-18 + AdamW, about 134 MB; the tutorial ConvNet + AdamW, about 0.4 MB):
  raw     write + fsync of the very bytes torch.save produces, to the same folder;
  sync    CheckpointManager.save, synchronous: serialise, checksum, write, fsync, rename, prune;
  async   CheckpointManager.save with --async-checkpoint: the time training is blocked, and the whole
          background write, awaited with finish(). Blocked is save()'s own time plus, after one training
          forward and backward pass of the model (batch 32), the wait in before_update() for the parameters'
          copy, which the background thread makes meanwhile; "all copied at save" is the same save with every
          tensor copied before save() returns, as all were before;
and, in the details, the pieces that show where the time goes: torch.save into memory, CRC-32 and
SHA-256 of the bytes, and torch.save to a path (PyTorch's C++ file writer) + fsync.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.harness.context import Context
from bench.harness.measure import load_average
from bench.harness.results import FigureResult, Goal, Row
from trainer.build import state_parts
from trainer.checkpoint import CheckpointManager, StateParts, TaskRecord, TrainingPosition, TrainingState, add_run_parts
from trainer.config import CheckpointConfig, DistConfig
from trainer.distributed import Runtime, process_group
from trainer.launchers import identity_from_env
from trainer.models import build_model

TITLE = "Checkpointing"


def training_state(model_name: str, device: torch.device | None = None, image_size: int = 32,
                   classes: int = 10) -> tuple[StateParts, TrainingPosition, nn.Module]:
    """Model and AdamW state after one step (exp_avg and exp_avg_sq exist) on ``device`` (default: the CPU),
    as the trainer's checkpoint parts."""
    device = device or torch.device("cpu")
    torch.manual_seed(0)
    model = build_model(model_name, 3, (image_size, image_size), classes).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model(torch.randn(2, 3, image_size, image_size, device=device)).sum().backward()
    optimizer.step()
    parts = state_parts(model, optimizer, torch.amp.GradScaler(device.type, enabled=False))
    position = TrainingPosition()
    position.step = 1
    add_run_parts(parts, position, TaskRecord("classification", "classification", {"model": model_name}), {})
    return parts, position, model


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _synced(path: Path, flags: int = os.O_RDONLY) -> None:
    """fsync a file's contents, or a folder's entries."""
    descriptor = os.open(path, flags)
    os.fsync(descriptor)
    os.close(descriptor)


def _raw_write(folder: Path, data: bytes) -> None:
    """What any durable write of these bytes costs: the file, its contents synced, then its folder entry."""
    path = folder / "raw.bin"
    path.write_bytes(data)
    _synced(path)
    _synced(folder)
    path.unlink()


def _torch_save_to_path(folder: Path, state: dict[str, Any]) -> None:
    path = folder / "torch-save.pt"
    torch.save(state, path)
    _synced(path)
    path.unlink()


def _forward_backward(model: nn.Module, batch: torch.Tensor) -> None:
    """The training work an asynchronous save's background copy overlaps: the next step's gradients (waited
    for on a GPU, whose work is otherwise only queued)."""
    model(batch).sum().backward()
    if batch.is_cuda:  # the training stream only: an asynchronous save's copies on their side stream go on
        torch.cuda.current_stream(batch.device).synchronize()


def _save_and_wait(manager: CheckpointManager, state: TrainingState, device: torch.device) -> None:
    manager.save(state)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _before_update(manager: CheckpointManager, device: torch.device) -> None:
    manager.before_update()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def measure(name: str, parts: StateParts, position: TrainingPosition, model: nn.Module, folder: Path,
            runtime: Runtime, repeats: int, batch: torch.Tensor | None = None) -> dict[str, Any]:
    """Every save of the figure, ``repeats`` times interleaved; ``batch`` is what the overlapped forward and
    backward pass trains on (default: 32 CPU images of 32x32)."""
    state = parts.capture(1).to_dict()
    batch = torch.randn(32, 3, 32, 32) if batch is None else batch
    log = logging.getLogger("checkpoint-bench")
    sync = CheckpointManager(CheckpointConfig(keep_last=2), str(folder / "sync"), runtime, log)
    background = CheckpointManager(CheckpointConfig(keep_last=2, async_checkpoint=True), str(folder / "async"),
                                   runtime, log)
    for manager in (sync, background):
        manager.prepare()
    try:
        return _measure(name, parts, position, model, state, batch, folder, sync, background, repeats)
    finally:
        for manager in (sync, background):
            manager.close()  # the folder's lease: released, its renewal stopped before the folder is removed


def _measure(name: str, parts: StateParts, position: TrainingPosition, model: nn.Module, state: dict[str, Any],
             batch: torch.Tensor, folder: Path, sync: CheckpointManager, background: CheckpointManager,
             repeats: int) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    times: dict[str, list[float]] = {key: [] for key in ("raw_write_fsync", "sync_save", "async_blocked",
                                                         "async_total", "async_blocked_all_copied_at_save",
                                                         "forward_backward", "forward_backward_alone",
                                                         "torch_save_to_memory", "crc32",
                                                         "sha256", "torch_save_to_path_fsync")}
    for step in range(1, repeats + 1):  # interleaved: a slow moment of the machine hits every method alike
        times["raw_write_fsync"].append(_timed(lambda: _raw_write(folder, data)))
        position.step = step
        typed = parts.capture(1)  # as the trainer does at each save: the parts' values, not copies
        times["sync_save"].append(_timed(lambda typed=typed: sync.save(typed)))
        times["forward_backward_alone"].append(_timed(lambda: _forward_backward(model, batch)))
        started = time.perf_counter()
        background.save(typed, changed_by_step_only=parts.changed_by_step_only)
        blocked = time.perf_counter() - started
        times["forward_backward"].append(_timed(lambda: _forward_backward(model, batch)))
        # Blocked: save() itself, what the copies running beside the forward and backward cost them, and the wait
        # before the optimizer step (on a GPU a wait of the stream, timed up to the moment the device is past it).
        blocked += times["forward_backward"][-1] - times["forward_backward_alone"][-1]  # unclipped: the median is fair
        blocked += _timed(lambda: _before_update(background, batch.device))
        times["async_blocked"].append(blocked)
        background.finish()
        times["async_total"].append(time.perf_counter() - started)
        # Every tensor copied at save(): on a GPU the training stream waits for all of the copies.
        times["async_blocked_all_copied_at_save"].append(_timed(lambda typed=typed: _save_and_wait(background, typed,
                                                                                                  batch.device)))
        background.finish()
        times["torch_save_to_memory"].append(_timed(lambda: torch.save(state, io.BytesIO())))
        times["crc32"].append(_timed(lambda: zlib.crc32(data)))
        times["sha256"].append(_timed(lambda: hashlib.sha256(data).digest()))
        times["torch_save_to_path_fsync"].append(_timed(lambda: _torch_save_to_path(folder, state)))
    medians = {key: statistics.median(values) for key, values in times.items()}
    size = len(data)
    return {
        "state": name,
        "bytes": size,
        "repeats": repeats,
        "median_s": {key: round(value, 5) for key, value in medians.items()},
        "gb_per_s": {key: round(size / value / 1e9, 3) for key, value in medians.items()},
        "save_vs_raw_throughput": round(medians["raw_write_fsync"] / medians["sync_save"], 3),
        "async_blocked_vs_sync_save": round(medians["async_blocked"] / medians["sync_save"], 3),
        "async_blocked_all_copied_at_save_vs_sync_save": round(medians["async_blocked_all_copied_at_save"]
                                                               / medians["sync_save"], 3),
    }


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    states, repeats = ctx.pick(["resnet18", "convnet"], ["convnet"]), ctx.pick(7, 3)
    work = Path(tempfile.mkdtemp(prefix="checkpoint-bench-", dir=ctx.work_dir))
    try:
        with process_group(DistConfig(device="cpu"), identity_from_env({}), torch.device("cpu")) as runtime:
            results = [measure(name, *training_state(name), work / name, runtime, repeats) for name in states]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for result in results:
        label = f"{result['state']}, {result['bytes'] / 1e6:.1f} MB"
        rate, median = result["gb_per_s"], result["median_s"]
        big = result["bytes"] > 10e6  # the goals differ: fixed costs dominate a small save
        rows.append(Row(f"save throughput / raw write+fsync of the same bytes ({label})",
                        result["save_vs_raw_throughput"], Goal(">=", 0.9 if big else 0.5),
                        notes=f"save {rate['sync_save']} GB/s, raw {rate['raw_write_fsync']} GB/s, "
                              f"median of {repeats}"))
        rows.append(Row(f"asynchronous save's blocked time / synchronous save ({label})",
                        result["async_blocked_vs_sync_save"], Goal("<=", 0.05),
                        notes=f"blocked {median['async_blocked'] * 1e3:.1f} ms (save(), the copies' cost to a "
                              f"{median['forward_backward_alone'] * 1e3:.0f} ms forward and backward, the wait "
                              f"before the next optimizer step), sync save {median['sync_save'] * 1e3:.1f} ms; "
                              f"every tensor copied at save: {median['async_blocked_all_copied_at_save'] * 1e3:.1f} "
                              f"ms"))
    details = {"results": results, "torch": str(torch.__version__), "threads": torch.get_num_threads(),
               "load_average": [load_before, load_average()]}
    return FigureResult(7, "checkpoint", TITLE, rows, details)
