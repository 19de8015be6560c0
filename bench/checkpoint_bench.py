"""Checkpoint save speed against the disk's own speed, measured in one run, interleaved, median of N.

For each training state (ResNet-18 + AdamW, about 134 MB; the tutorial ConvNet + AdamW, about 0.4 MB):
  raw     write + fsync of the very bytes torch.save produces, to the same folder;
  sync    CheckpointManager.save, synchronous: serialise, checksum, write, fsync, rename, prune;
  async   CheckpointManager.save with --async-checkpoint: the time training is blocked (snapshot copy),
          and the whole background write, awaited with finish();
and the pieces, to see where time goes: torch.save into memory, CRC-32 and SHA-256 of the bytes,
torch.save to a path (PyTorch's C++ file writer) + fsync, and the previous save pipeline (serialise
into memory, SHA-256, write + fsync).

    python -m bench.checkpoint_bench [--quick] [--dir FOLDER]

Writes bench/results/checkpoint.json and bench/results/checkpoint.md.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
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
import torch.distributed as dist

from trainer.checkpoint import CheckpointManager
from trainer.checkpoint.storage import fsync_dir
from trainer.config import CheckpointConfig, DistConfig
from trainer.distributed import Runtime, destroy_process_group, init_process_group
from trainer.env import identity_from_env
from trainer.models import build_model

RESULTS = Path(__file__).resolve().parent / "results"


def training_state(model_name: str) -> dict[str, Any]:
    """Model and AdamW state after one step (exp_avg and exp_avg_sq exist), as the trainer saves them."""
    torch.manual_seed(0)
    model = build_model(model_name, 3, (32, 32), 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "position": {"step": 1}}


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _raw_write(folder: Path, data: bytes) -> None:
    path = folder / "raw.bin"
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(folder)
    path.unlink()


def _torch_save_to_path(folder: Path, state: dict[str, Any]) -> None:
    path = folder / "torch-save.pt"
    torch.save(state, path)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    path.unlink()


def _previous_pipeline(folder: Path, state: dict[str, Any]) -> None:
    """What CheckpointManager did before streaming: serialise into memory, SHA-256, then write + fsync."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    hashlib.sha256(data).hexdigest()
    _raw_write(folder, data)


def measure(name: str, state: dict[str, Any], folder: Path, runtime: Runtime, repeats: int) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    log = logging.getLogger("checkpoint-bench")
    sync = CheckpointManager(CheckpointConfig(keep_last=2), str(folder / "sync"), runtime, log)
    background = CheckpointManager(CheckpointConfig(keep_last=2, async_checkpoint=True), str(folder / "async"),
                                   runtime, log)
    for manager in (sync, background):
        manager.prepare()
    times: dict[str, list[float]] = {key: [] for key in ("raw_write_fsync", "sync_save", "async_blocked",
                                                         "async_total", "torch_save_to_memory", "crc32",
                                                         "sha256", "torch_save_to_path_fsync",
                                                         "previous_pipeline")}
    for step in range(1, repeats + 1):  # interleaved: a slow moment of the machine hits every method alike
        times["raw_write_fsync"].append(_timed(lambda: _raw_write(folder, data)))
        times["sync_save"].append(_timed(lambda step=step: sync.save(state, {"step": step})))
        started = time.perf_counter()
        background.save(state, {"step": step})
        times["async_blocked"].append(time.perf_counter() - started)
        background.finish()
        times["async_total"].append(time.perf_counter() - started)
        times["torch_save_to_memory"].append(_timed(lambda: torch.save(state, io.BytesIO())))
        times["crc32"].append(_timed(lambda: zlib.crc32(data)))
        times["sha256"].append(_timed(lambda: hashlib.sha256(data).digest()))
        times["torch_save_to_path_fsync"].append(_timed(lambda: _torch_save_to_path(folder, state)))
        times["previous_pipeline"].append(_timed(lambda: _previous_pipeline(folder, state)))
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
    }


def run(quick: bool, folder: Path | None = None) -> dict[str, Any]:
    """Measure and return the figures (no files written); quick: the small state only, fewer repeats.

    Top-level entries are the ratios, as {"measure", "ratio", "notes"}; everything else is under "details".
    """
    states = ["convnet"] if quick else ["resnet18", "convnet"]
    repeats = 3 if quick else 7
    owns_group = not dist.is_initialized()
    runtime = (init_process_group(DistConfig(), identity_from_env({}), torch.device("cpu")) if owns_group else
               Runtime(identity_from_env({}), torch.device("cpu"), dist.get_backend()))
    work = Path(tempfile.mkdtemp(prefix="checkpoint-bench-", dir=folder))
    try:
        results = [measure(name, training_state(name), work / name, runtime, repeats) for name in states]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if owns_group:
            destroy_process_group()
    figures: dict[str, Any] = {}
    for row in results:
        label = f"{row['state']}, {row['bytes'] / 1e6:.1f} MB"
        rate, median = row["gb_per_s"], row["median_s"]
        figures[f"save_vs_raw_{row['state']}"] = {
            "measure": f"save throughput / raw write+fsync of the same bytes ({label})",
            "ratio": row["save_vs_raw_throughput"],
            "notes": f"save {rate['sync_save']} GB/s, raw {rate['raw_write_fsync']} GB/s, median of {repeats}"}
        figures[f"async_blocked_vs_sync_{row['state']}"] = {
            "measure": f"asynchronous save's blocked time / synchronous save ({label})",
            "ratio": row["async_blocked_vs_sync_save"],
            "notes": f"blocked {median['async_blocked'] * 1e3:.1f} ms, sync save {median['sync_save'] * 1e3:.1f} ms"}
    figures["details"] = {"quick": quick, "folder": str(folder or tempfile.gettempdir()),
                          "torch": str(torch.__version__), "threads": torch.get_num_threads(), "results": results}
    return figures


def markdown(figures: dict[str, Any]) -> str:
    details = figures["details"]
    lines = [
        f"# Checkpoint save vs raw write (median of {details['results'][0]['repeats']}, interleaved, "
        f"folder {details['folder']}, {details['threads']} threads)",
        "",
        "| state | MB | raw write+fsync GB/s | sync save GB/s | save/raw | async blocked ms | sync save ms | "
        "blocked/sync | async total ms | torch.save→memory GB/s | crc32 GB/s | sha256 GB/s | "
        "torch.save(path)+fsync GB/s | previous save (memory+sha256) GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in details["results"]:
        rate, median = row["gb_per_s"], row["median_s"]
        lines.append(
            f"| {row['state']} | {row['bytes'] / 1e6:.1f} | {rate['raw_write_fsync']} | {rate['sync_save']} | "
            f"{row['save_vs_raw_throughput']} | {median['async_blocked'] * 1e3:.1f} | {median['sync_save'] * 1e3:.1f}"
            f" | {row['async_blocked_vs_sync_save']} | {median['async_total'] * 1e3:.1f} | "
            f"{rate['torch_save_to_memory']} | {rate['crc32']} | {rate['sha256']} | "
            f"{rate['torch_save_to_path_fsync']} | {rate['previous_pipeline']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="the small state only, 3 repeats")
    parser.add_argument("--dir", type=Path, default=None, help="folder to write in (default: the temp folder)")
    args = parser.parse_args()
    figures = run(args.quick, args.dir)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "checkpoint.json").write_text(json.dumps(figures, indent=2) + "\n")
    (RESULTS / "checkpoint.md").write_text(markdown(figures))
    print(markdown(figures))


if __name__ == "__main__":
    main()
