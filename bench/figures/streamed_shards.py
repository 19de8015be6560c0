"""Figure 16: streamed shards: training from tar shards on an S3-compatible store, against the same images as files
on local disk and in memory; what the nodes fetch and hold; what a rank keeps for a huge dataset.

The data: JPEG files of 64x64 (figure 9's write_images, 10 classes, 8,000 for training) written as shards with
``ddp-shard write --dataset imagefolder`` (the same train/eval split as ``--dataset imagefolder``) to moto's S3
server on loopback (devtools/s3_server.py), which the trainer reaches through s3fs as it would reach AWS or MinIO.
Twice, at two shard sizes:
  streaming shards  4 MB, about 600 samples each, as many as a 64 MB shard of ImageNet's JPEGs holds, read with
                    the defaults (12 lanes, windows of a shard, the default bound: the whole set fits);
  bounded shards    0.25 MB, about 40 samples each, read under a node cache bound (--shard-cache-gb) 12x smaller
                    than the training shards: the smallest bound the trainer accepts for them at 2 and at 3 ranks, by
                    its own sizing (ShardedDistributedSampler.bytes_needed, and its evaluation shard check), plus
                    3 %, with --shard-window 0.5 (at windows of a whole shard the bound would be a fifth of the data).
A dataset 10x its node's bound must have shards far smaller than a real one's on a set this small: a window (one
range request) is about 20 samples there, and each request costs the client (s3fs's event loop, in the rank's
process) about 4 ms of CPU, as much as decoding 15 of these images, on the same 2 cores; so the throughput that
the goal holds is the streaming shards', the bounded shards' is in its notes.

Every run is the trainer under torchrun with 2 ranks (3 after a resize) on this machine: the ConvNet,
--image-size 64, --global-batch-size 48, one DataLoader worker per rank, one thread per rank. Round after round:
  epoch, streaming shards  the first 100 steps of an epoch: samples/s, the median of the logged windows (of 10
                           steps), the first left out;
  epoch, files             the same steps over the same JPEG files, map-style from local disk (--dataset imagefolder);
  epoch, bounded shards    a whole epoch: the bytes fetched at a fixed world size (every fetch is a line of a cache
                           folder's fetched.log: the pieces, and the shards' own indexes), and the cache, polled;
  resized, bounded shards  2 ranks to step K (40 % of the epoch), then 3 ranks resuming there to the epoch's end,
                           each segment with a --shard-cache-dir of its own: the bytes of the whole epoch, the cache,
                           and the time from each launch to its first step (--log-every 1);
  resized, in memory       the same two segments over --dataset synthetic of the same shape and sample count, read
                           from a file made before the rounds, the resumed one stopped two steps in: the reference
                           for the times to the first step.
Bytes are over the train shards' bytes as index.json lists them (the tar files whole: the samples' own bytes are a
little less, the tar format's end blocks and padding, which no rank needs). Evaluation's fetches are not counted.
The cache is the size of every ``*.piece`` file (and piece being written) under the run's --shard-cache-dir, all
ranks' training and evaluation folders together, read every 50 ms by this process: the node's, against the node's
bound (the trainer gives each of a node's ranks an equal share: evaluation's need, the rest to training).

Then, computed in this process with no server: the memory one rank holds for the dataset's index, the epoch's
order and its plan (trainer.data.shards.order.ShardOrder, trainer.data.shards.prefetch.rank_plan) for 10^8 samples,
rank 0 of 8, traced with tracemalloc (Python objects), against the same for 10^6 samples in as many shards.

Quick mode (CI's smoke run) writes one tiny dataset (shards of 15 samples) for every case, runs one round and leaves
out the peers and 10^5 shards; its numbers are not representative.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import sysconfig
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.figures.image_folder import CLASSES, SIZE, write_images
from bench.harness.context import Context
from bench.harness.launch import BenchError, TrainerRun, environment, read_metrics, run_trainer
from bench.harness.launch import run as run_command
from bench.harness.measure import load_average, median, paired_ratio
from bench.harness.results import FigureResult, Goal, Row
from devtools.processes import BIN_DIR
from devtools.s3_server import S3Server, s3_server
from trainer.data import cached_synthetic, load_imagefolder
from trainer.data.shards import (
    BlockSampler,
    OrderSettings,
    ShardedDataset,
    ShardedDistributedSampler,
    ShardEntry,
    ShardIndex,
    ShardOrder,
    auto_lanes,
    rank_plan,
    read_ahead_samples,
)

TITLE = "Streamed shards from an S3-compatible store (loopback, 2 ranks)"
THROUGHPUT_GOAL, PEER_GOAL = Goal(">=", 0.95), Goal(">=", 1.0)
FIXED_BYTES_GOAL, RESIZED_BYTES_GOAL, CACHE_GOAL = Goal("<=", 1.05), Goal("<=", 1.25), Goal("<=", 1.0)
FIRST_STEP_GOAL = Goal("<=", 1.2)
RANKS, RESIZED_RANKS = 2, 3
GLOBAL_BATCH = 48  # divides into 2 and 3 ranks: every step trains the same samples before and after the resize
WORKERS = 1  # DataLoader workers per rank, every case alike: --num-workers auto's choice on 2 cores
WINDOW_SHARDS = 0.5  # --shard-window: see the module's docstring
EVAL_SAMPLES = 256  # --max-test-samples: the evaluation at each segment's end, kept short
EVAL_BATCH = 8  # --eval-batch-size: small, so that evaluation holds few shards at once (BlockSampler.bytes_needed)
BOUND_MARGIN = 1.03
POLL_S = 0.05
TIMEOUT_S = 300
MEMORY_WORLD = 8
MEMORY_SAMPLES = (10**8, 10**6)
MEMORY_SHARDS = (10**4, 10**5)


@dataclass(frozen=True)
class Sizes:
    per_class: int  # JPEG files per class; a tenth of them (--eval-fraction 0.1) are the evaluation split
    bounded_shard_mb: float  # ddp-shard write --shard-mb of the bounded shards
    streaming_shard_mb: float | None  # and of the streaming shards (None: the bounded ones serve for both)
    log_every: int  # the epochs' metrics windows
    throughput_steps: int  # the steps of the epochs timed only (from streaming shards, from files); 0: all
    rounds: int


# 8,000 training images: 50 MB of shards
FULL = Sizes(per_class=889, bounded_shard_mb=0.25, streaming_shard_mb=4.0, log_every=10, throughput_steps=100,
             rounds=2)
QUICK = Sizes(per_class=30, bounded_shard_mb=0.1, streaming_shard_mb=None, log_every=2, throughput_steps=0, rounds=1)


@dataclass
class Dataset:
    """The shards on the server, as the figure measures against them."""

    url: str
    train: list[ShardEntry]
    train_bytes: int  # the train shards' bytes, as index.json lists them
    sample_bytes: int  # the train samples' own bytes (their spans in the shards' indexes)
    sidecar_bytes: int  # the train shards' own indexes (NAME.idx.json), each once
    eval_samples: int

    @property
    def train_samples(self) -> int:
        return sum(entry.samples for entry in self.train)


@dataclass
class CachePoll:
    """The size of the pieces under a cache folder, read every POLL_S seconds while a run goes on."""

    folder: Path
    peak: int = 0
    peak_by_folder: dict[str, int] = field(default_factory=dict)  # each rank's train-/eval- folder, its own peak
    polls: int = 0

    def once(self) -> None:
        total, by_folder = 0, {}
        for path, _, files in os.walk(self.folder):
            size = 0
            for name in files:
                if ".piece" in name:  # NAME.piece and the temporary .NAME.piece.<id> being written
                    with contextlib.suppress(FileNotFoundError):  # evicted between the listing and the stat
                        size += os.stat(os.path.join(path, name)).st_size
            if size:
                by_folder[Path(path).name] = size
                total += size
        self.peak = max(self.peak, total)
        for name, size in by_folder.items():
            self.peak_by_folder[name] = max(self.peak_by_folder.get(name, 0), size)
        self.polls += 1


@contextlib.contextmanager
def polled(folder: Path) -> Iterator[CachePoll]:
    poll = CachePoll(folder)
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(POLL_S):
            poll.once()

    thread = threading.Thread(target=loop, name="cache-poll", daemon=True)
    thread.start()
    try:
        yield poll
    finally:
        stop.set()
        thread.join()


@dataclass
class Fetched:
    """What a run's caches took from the store for training."""

    piece_bytes: int = 0
    pieces: int = 0
    sidecar_bytes: int = 0
    sidecars: int = 0

    @property
    def total(self) -> int:
        return self.piece_bytes + self.sidecar_bytes

    def __add__(self, other: Fetched) -> Fetched:
        return Fetched(self.piece_bytes + other.piece_bytes, self.pieces + other.pieces,
                       self.sidecar_bytes + other.sidecar_bytes, self.sidecars + other.sidecars)


def fetched(cache_dir: Path) -> Fetched:
    """What the training caches under ``cache_dir`` fetched, from their fetched.log files (a line a fetch: ``WHO SHARD
    FIRST END BYTES``, FIRST = END = -1 for a shard's own index); evaluation's caches are left out."""
    result = Fetched()
    for log in cache_dir.glob("*/train-rank*/fetched.log"):
        for line in log.read_text().splitlines():
            _, _, first, _, size = line.split()
            if first == "-1":
                result.sidecar_bytes, result.sidecars = result.sidecar_bytes + int(size), result.sidecars + 1
            else:
                result.piece_bytes, result.pieces = result.piece_bytes + int(size), result.pieces + 1
    return result


def first_step_after(run: TrainerRun) -> float:
    """Seconds from the run's launch to its first training record (--log-every 1: its first step); a resumed run's
    metrics.jsonl holds the earlier segment's records too, which this skips."""
    times = [record["time"] for record in run.train_records() if record["time"] >= run.launched_at]
    if not times:
        raise BenchError("no training record after the launch: the run stopped before its first step")
    return min(times) - run.launched_at


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    sizes = ctx.pick(FULL, QUICK)
    images = ctx.scratch("streamed-shards-images")
    write_images(images, sizes.per_class)
    with s3_server() as server, environment(server.env):  # s3fs (botocore) in this process and the runs' reads it
        bounded = _write_shards(server, images, sizes.bounded_shard_mb)
        streaming = bounded if sizes.streaming_shard_mb is None else _write_shards(server, images,
                                                                                   sizes.streaming_shard_mb)
        steps = -(-bounded.train_samples // GLOBAL_BATCH)
        resize_step = max(1, round(0.4 * steps))
        bound_gb = _cache_bound_gb(bounded, resize_step * GLOBAL_BATCH)
        peers, unavailable = ({}, {}) if ctx.quick else _peer_datasets(ctx, server, images)
        cases = _Cases(ctx, server, streaming, bounded, images, sizes, bound_gb, resize_step, peers)
        rounds = [cases.round(index) for index in range(sizes.rounds)]
    memory = _order_memory(ctx.pick(MEMORY_SHARDS, MEMORY_SHARDS[:1]))  # 10^5 shards: 2.5 s more
    rows = _rows(rounds, streaming, bounded, bound_gb, resize_step, steps, memory, ctx.quick)
    rows += _peer_rows(rounds, unavailable, ctx.quick)
    shuffle = _shuffle_quality()
    rows += _shuffle_rows(shuffle)
    details: dict[str, Any] = {
        "rounds": rounds, "memory": memory, "shuffle": shuffle, "cache_bound_gb": bound_gb, "resize_step": resize_step,
        "steps_per_epoch": steps, "train_samples": bounded.train_samples, "trainer_args": cases.common,
        "datasets": {name: {"shards": len(data.train), "train_bytes": data.train_bytes,
                            "sample_bytes": data.sample_bytes, "sidecar_bytes": data.sidecar_bytes}
                     for name, data in (("streaming", streaming), ("bounded", bounded))},
        "load_average": [load_before, load_average()]}
    return FigureResult(16, "shards", TITLE, rows, details)


def _write_shards(server: S3Server, images: Path, shard_mb: float) -> Dataset:
    url = f"s3://{server.new_bucket()}/images"
    run_command([str(BIN_DIR / "ddp-shard"), "write", "--dataset", "imagefolder", "--data-dir", str(images),
                 "--output", url, "--shard-mb", str(shard_mb), "--image-size", str(SIZE)], TIMEOUT_S)
    train = ShardedDataset(url, "train")
    sample_bytes = sidecar_bytes = 0
    for entry in train.shards:
        sidecar = train.store.read(entry.sidecar)
        sidecar_bytes += len(sidecar)
        sample_bytes += sum(span.end - span.start for span in ShardIndex.from_json(sidecar, entry.sidecar).samples)
    return Dataset(url, train.shards, sum(entry.bytes for entry in train.shards), sample_bytes, sidecar_bytes,
                   len(ShardedDataset(url, "eval")))


def _cache_bound_gb(dataset: Dataset, resume_sample: int) -> float:
    """The smallest --shard-cache-gb the trainer accepts for both segments of a resized epoch (2 ranks from the
    start, 3 from ``resume_sample``), by its own sizing (trainer.data.shards.fetching), with a margin."""
    train = ShardedDataset(dataset.url, "train")
    evaluated = ShardedDataset(dataset.url, "eval").head(EVAL_SAMPLES)
    needed = 0.0
    # At 3 ranks both: the trainer checks a fresh epoch as it attaches the caches (the next epoch's need), then
    # the resumed one as it starts.
    for world, start in ((RANKS, 0), (RESIZED_RANKS, 0), (RESIZED_RANKS, resume_sample)):
        batch = GLOBAL_BATCH // world
        for rank in range(world):
            sampler = ShardedDistributedSampler(train, world, rank, 0, batch, OrderSettings(0, WINDOW_SHARDS))
            sampler.set_epoch(0, start)
            lag, eval_lag = read_ahead_samples(batch, WORKERS, None), read_ahead_samples(EVAL_BATCH, WORKERS, None)
            rank_needs = sampler.bytes_needed(lag) + BlockSampler(evaluated, world, rank).bytes_needed(eval_lag)
            needed = max(needed, rank_needs * world)  # the node's bound is its ranks' equal shares
    return round(needed * BOUND_MARGIN / 1e9, 6)


class _Cases:
    """The cases of a round (see the module's docstring), each run in folders of its own."""

    def __init__(self, ctx: Context, server: S3Server, streaming: Dataset, bounded: Dataset, images: Path,
                 sizes: Sizes, bound_gb: float, resize_step: int, peers: dict[str, tuple[Path, str]]) -> None:
        self.ctx, self.server, self.sizes, self.resize_step, self.peers = ctx, server, sizes, resize_step, peers
        self.separate_streaming = streaming is not bounded
        self.common = ["--model", "convnet", "--image-size", str(SIZE), "--global-batch-size", str(GLOBAL_BATCH),
                       "--eval-batch-size", str(EVAL_BATCH), "--max-test-samples", str(EVAL_SAMPLES), "--num-workers",
                       str(WORKERS), "--epochs", "1"]
        self.streaming = ["--dataset", "shards", "--data-dir", streaming.url]
        self.bounded = ["--dataset", "shards", "--data-dir", bounded.url, "--shard-cache-gb", f"{bound_gb:.6f}",
                        "--shard-window", str(WINDOW_SHARDS)]
        self.files = ["--dataset", "imagefolder", "--data-dir", str(images), "--eval-fraction", "0.1"]
        # In memory: read from a file made once before the rounds (trainer.data.synthetic.cached_synthetic), since
        # generating 8,000 images took each run about 2 s of its start here.
        synthetic_cache = ctx.scratch("streamed-shards-synthetic")
        cached_synthetic(synthetic_cache, (3, SIZE, SIZE), CLASSES, bounded.train_samples, bounded.eval_samples)
        self.memory = ["--dataset", "synthetic", "--synthetic-shape", f"3,{SIZE},{SIZE}", "--synthetic-classes",
                       str(CLASSES), "--synthetic-train-size", str(bounded.train_samples), "--synthetic-test-size",
                       str(bounded.eval_samples), "--data-cache-dir", str(synthetic_cache)]

    def round(self, index: int) -> dict[str, Any]:
        work = self.ctx.scratch(f"streamed-shards-{index}")
        # Only timed: the streaming shards' and the files' epochs can stop early; the bounded one, whose bytes count,
        # cannot (in quick mode it is the streaming one too).
        timed = ["--max-steps", str(self.sizes.throughput_steps)] if self.sizes.throughput_steps else []
        result = {}
        if self.separate_streaming:
            result["epoch_streaming"] = self._epoch(work, "epoch-streaming", self.streaming, timed)
        for name, (python, url) in self.peers.items():  # in the round, next to the trainer's: paired ratios
            result[f"peer_{name}"] = _peer_epoch(python, name, url, work, self.server, self.sizes.throughput_steps,
                                                 self.sizes.log_every)
        result["epoch_files"] = self._epoch(work, "epoch-files", self.files, timed)
        result["epoch_bounded"] = self._epoch(work, "epoch-bounded", self.bounded, [])
        result["resized_bounded"] = self._resized(work, "resized-bounded", self.bounded)
        result["resized_memory"] = self._resized(work, "resized-memory", self.memory)
        return result

    def _epoch(self, work: Path, name: str, data: list[str], extra: list[str]) -> dict[str, Any]:
        """An epoch at 2 ranks: samples/s; from shards, what was fetched and held, and the server's CPU time."""
        from_shards, cache = data is not self.files, work / f"{name}-cache"
        server_cpu = cpu_seconds(self.server.process.pid)
        with polled(cache) as poll:
            trainer = run_trainer([*self.common, *data, *(["--shard-cache-dir", str(cache)] if from_shards else []),
                                   "--log-every", str(self.sizes.log_every), *extra], work / name, RANKS, TIMEOUT_S)
        result: dict[str, Any] = {"samples_per_s": trainer.steady_samples_per_s()}
        if from_shards:
            result.update(fetched=vars(fetched(cache)), cache_peak=poll.peak, cache_peak_by_folder=poll.peak_by_folder,
                          server_cpu_s=cpu_seconds(self.server.process.pid) - server_cpu,
                          wall_s=time.time() - trainer.launched_at)
        return result

    def _resized(self, work: Path, name: str, data: list[str]) -> dict[str, Any]:
        """2 ranks to the resize step, then 3 ranks from its checkpoint to the epoch's end, in one output folder."""
        out = work / name
        from_shards = data is not self.memory
        result: dict[str, Any] = {}
        total, peak, peaks = Fetched(), 0, {}
        # In memory, only the time to the first step counts: the resumed segment stops after two steps.
        resumed_until = [] if from_shards else ["--max-steps", str(self.resize_step + 2)]
        for segment, ranks, extra in (("fresh", RANKS, ["--max-steps", str(self.resize_step)]),
                                      ("resumed", RESIZED_RANKS, ["--resume", "latest", *resumed_until])):
            cache = work / f"{name}-cache-{segment}"  # a folder per segment: its fetched.log files survive
            with polled(cache) as poll:
                trainer = run_trainer([*self.common, *data, *(["--shard-cache-dir", str(cache)] if from_shards else []),
                                       "--log-every", "1", *extra], out, ranks, TIMEOUT_S)
            result[f"{segment}_first_step_s"] = first_step_after(trainer)
            if from_shards:
                total += fetched(cache)
                peak = max(peak, poll.peak)
                peaks.update({f"{segment}/{folder}": size for folder, size in poll.peak_by_folder.items()})
        if from_shards:
            trained = {record["step"] for record in read_metrics(out / "metrics.jsonl") if record["kind"] == "train"}
            result.update(fetched=vars(total), cache_peak=peak, cache_peak_by_folder=peaks, steps=len(trained))
        return result


def _order_memory(shard_counts: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """Per shard count and sample count, the bytes of Python objects (tracemalloc) that rank 0 of MEMORY_WORLD keeps
    for the dataset's index (its shard entries), the epoch's order and the rank's plan, and the peak while building
    them; then what the permutations of the windows it reads at once add (one per lane of the rank)."""
    measured: dict[str, dict[str, float]] = {}
    for shards in shard_counts:
        for samples in MEMORY_SAMPLES:
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                per_shard, extra = divmod(samples, shards)
                index = [ShardEntry(f"train-{number:06d}.tar", per_shard + (number < extra), 64 << 20, 0, 0)
                         for number in range(shards)]
                order = ShardOrder([entry.samples for entry in index], 0, 0, auto_lanes(MEMORY_WORLD),
                                   max(1, round(samples / shards)))
                plan = rank_plan(order, 0, 0, MEMORY_WORLD)
                kept, peak = tracemalloc.get_traced_memory()
                for lane in range(0, order.lanes, MEMORY_WORLD):  # position `lane` is place 0 of lane `lane`
                    order.sample(lane)
                with_windows = tracemalloc.get_traced_memory()[0]
                measured[f"{shards}/{samples}"] = {
                    "shards": shards, "samples": samples, "kept_bytes": kept - before, "peak_bytes": peak - before,
                    "open_windows_bytes": with_windows - kept, "window": order.window,
                    "open_windows": order.lanes // MEMORY_WORLD, "planned_windows": len(plan)}
                del index, order, plan
            finally:
                tracemalloc.stop()
    return measured


def _rows(rounds: list[dict[str, Any]], streaming: Dataset, bounded: Dataset, bound_gb: float, resize_step: int,
          steps: int, memory: dict[str, dict[str, float]], quick: bool) -> list[Row]:
    def values(case: str, key: str) -> list[Any]:
        return [r[case][key] for r in rounds]

    def ratio_of(numerators: list[float], denominators: list[float]) -> tuple[float, tuple[float, float]]:
        ratio = paired_ratio(numerators, denominators)
        return ratio.median, ratio.spread

    def described(data: Dataset) -> str:
        return (f"{len(data.train)} shards of {data.train_samples / len(data.train):.0f} samples "
                f"({data.train_bytes / 1e6:.1f} MB)")

    streaming_case = "epoch_streaming" if "epoch_streaming" in rounds[0] else "epoch_bounded"
    files_sps = values("epoch_files", "samples_per_s")
    throughput, throughput_spread = ratio_of(values(streaming_case, "samples_per_s"), files_sps)
    bounded_throughput, _ = ratio_of(values("epoch_bounded", "samples_per_s"), files_sps)
    bound_bytes = bound_gb * 1e9
    bounded_setting = (f"{described(bounded)}, node bound {bound_bytes / 1e6:.2f} MB "
                       f"({bounded.train_bytes / bound_bytes:.1f}x smaller), --shard-window {WINDOW_SHARDS}")
    server_share = median([r[streaming_case]["server_cpu_s"] / (r[streaming_case]["wall_s"] * (os.cpu_count() or 1))
                           for r in rounds])
    quick_note = "; quick mode: tiny shards, the bound not 10x smaller" if quick else ""

    def bytes_row(measure: str, case: str, goal: Goal, extra: str) -> Row:
        fetches = values(case, "fetched")
        ratios = [(value["piece_bytes"] + value["sidecar_bytes"]) / bounded.train_bytes for value in fetches]
        pieces = median([value["piece_bytes"] for value in fetches])
        return Row(measure, median(ratios), goal, spread=(min(ratios), max(ratios)),
                   notes=f"pieces {pieces / 1e6:.2f} MB ({median([v['pieces'] for v in fetches]):.0f} range "
                         f"requests) + shard indexes {median([v['sidecar_bytes'] for v in fetches]) / 1e6:.2f} MB "
                         f"({median([v['sidecars'] for v in fetches]):.0f} GETs) of {bounded.train_bytes / 1e6:.2f} "
                         f"MB; the pieces alone over the samples' own bytes {pieces / bounded.sample_bytes:.3f}; "
                         f"{bounded_setting}{extra}")

    peaks = [max(r["epoch_bounded"]["cache_peak"], r["resized_bounded"]["cache_peak"]) / bound_bytes for r in rounds]
    folder_peaks: dict[str, int] = {}
    for r in rounds:
        for case in ("epoch_bounded", "resized_bounded"):
            for folder, size in r[case]["cache_peak_by_folder"].items():
                role = folder.split("/")[-1].split("-rank")[0]  # train or eval
                world = RESIZED_RANKS if folder.startswith("resumed/") else RANKS
                key = f"{role} at {world} ranks"
                folder_peaks[key] = max(folder_peaks.get(key, 0), size)
    by_folder = "; ".join(f"a rank's {key}: {size / 1e6:.2f} MB" for key, size in sorted(folder_peaks.items()))
    by_folder += "; a rank's share: " + ", ".join(f"{bound_bytes / world / 1e6:.2f} MB at {world} ranks"
                                                 for world in (RANKS, RESIZED_RANKS))
    fresh, fresh_spread = ratio_of(values("resized_bounded", "fresh_first_step_s"),
                                   values("resized_memory", "fresh_first_step_s"))
    resumed, resumed_spread = ratio_of(values("resized_bounded", "resumed_first_step_s"),
                                       values("resized_memory", "resumed_first_step_s"))

    def seconds(case: str, segment: str) -> float:
        return median(values(case, f"{segment}_first_step_s"))

    rows = [
        Row("epoch from shards on S3 / the same JPEGs map-style on local disk (samples/s, 2 ranks)", throughput,
            THROUGHPUT_GOAL, spread=throughput_spread,
            notes=f"{median(values(streaming_case, 'samples_per_s')):,.0f} against {median(files_sps):,.0f} "
                  f"samples/s (medians of {len(rounds)} round(s)); {described(streaming)}, the default lanes, window "
                  f"and bound; convnet, --global-batch-size {GLOBAL_BATCH}, --num-workers {WORKERS}; the S3 server "
                  f"on loopback used {100 * server_share:.0f}% of this machine's cores meanwhile. The bounded shards "
                  f"(below): {bounded_throughput:.3f} (a range request per {WINDOW_SHARDS:g} shard){quick_note}"),
        bytes_row("bytes fetched in an epoch at 2 ranks / the train shards' bytes", "epoch_bounded",
                  FIXED_BYTES_GOAL, quick_note),
        bytes_row(f"bytes fetched in an epoch resized 2 -> 3 ranks at step {resize_step} of {steps} / the train "
                  f"shards' bytes", "resized_bounded", RESIZED_BYTES_GOAL,
                  f"; each segment a cache folder of its own{quick_note}"),
        Row("peak cache of the node (all its ranks' pieces) / its bound (--shard-cache-gb)", max(peaks), CACHE_GOAL,
            spread=(min(peaks), max(peaks)),
            notes=f"{bounded_setting}; the highest of the bounded epoch's and resized epoch's runs, polled every "
                  f"{POLL_S * 1e3:.0f} ms; by folder, the highest: {by_folder}{quick_note}"),
        Row("time to the first step, fresh job at 2 ranks: bounded shards / in memory (--dataset synthetic)",
            fresh, FIRST_STEP_GOAL, spread=fresh_spread,
            notes=f"{seconds('resized_bounded', 'fresh'):.1f} s against {seconds('resized_memory', 'fresh'):.1f} s "
                  f"from the launch (torchrun) to the first step's record; synthetic 3x{SIZE}x{SIZE} images, as "
                  f"many, read from a file made before the rounds (--data-cache-dir), --num-workers {WORKERS} too"),
        Row(f"time to the first step, resumed at 3 ranks (step {resize_step}): bounded shards / in memory",
            resumed, FIRST_STEP_GOAL, spread=resumed_spread,
            notes=f"{seconds('resized_bounded', 'resumed'):.1f} s against "
                  f"{seconds('resized_memory', 'resumed'):.1f} s; the shards' run starts with an empty cache"),
    ]
    for shards in sorted({int(case["shards"]) for case in memory.values()}):
        many, few = (memory[f"{shards}/{samples}"] for samples in MEMORY_SAMPLES)
        rows.append(Row(
            f"memory of a rank (0 of {MEMORY_WORLD}) for index + order + plan: {MEMORY_SAMPLES[0]:.0e} / "
            f"{MEMORY_SAMPLES[1]:.0e} samples in {shards:.0e} shards", many["kept_bytes"] / few["kept_bytes"],
            notes=f"{many['kept_bytes'] / 1e6:.2f} MB ({many['peak_bytes'] / 1e6:.2f} MB at the peak while built) "
                  f"against {few['kept_bytes'] / 1e6:.2f} MB: O(shards), where O(samples) would be "
                  f"{MEMORY_SAMPLES[0] // MEMORY_SAMPLES[1]}x (the rest: at {MEMORY_SAMPLES[1]:.0e} samples the "
                  f"numbers within a shard are CPython's shared small ints); {many['planned_windows']:.0f} windows "
                  f"planned; the "
                  f"permutations of the {many['open_windows']:.0f} windows read at once add "
                  f"{many['open_windows_bytes'] / 1e6:.2f} MB (windows of {many['window']:.0f} samples) against "
                  f"{few['open_windows_bytes'] / 1e6:.3f} MB: O(window); tracemalloc, Python objects"))
    return rows


# -- the shuffle's quality, computed --------------------------------------------------------------------------------

SHUFFLE_SHARDS, SHUFFLE_SHARD_SAMPLES, SHUFFLE_BATCH = 200, 500, 256
SHUFFLE_ORDERS = {"12 lanes, window 1 shard (auto at <= 12 ranks)": (12, 1.0),
                  "12 lanes, window 4 shards (--shard-window 4)": (12, 4.0),
                  "48 lanes, window 1 shard (--shard-lanes 48)": (48, 1.0)}


def _shuffle_quality() -> dict[str, dict[str, float]]:
    """Per order (and a full shuffle, as map-style data gets): how far a shard's samples spread over the epoch (the
    positions between its first and last sample, over the epoch, the mean over shards), and how many distinct shards
    a global batch draws from (the mean over batches); epoch 0, seed 0."""
    size = SHUFFLE_SHARDS * SHUFFLE_SHARD_SAMPLES
    counts = [SHUFFLE_SHARD_SAMPLES] * SHUFFLE_SHARDS
    orders: dict[str, list[int]] = {"full shuffle (map-style)": torch.randperm(
        size, generator=torch.Generator().manual_seed(0)).tolist()}
    for label, (lanes, window_shards) in SHUFFLE_ORDERS.items():
        order = ShardOrder(counts, 0, 0, lanes, round(window_shards * SHUFFLE_SHARD_SAMPLES))
        orders[label] = [order.sample(position) for position in range(size)]
    measured = {}
    for label, samples in orders.items():
        first, last = [size] * SHUFFLE_SHARDS, [-1] * SHUFFLE_SHARDS
        for position, sample in enumerate(samples):
            shard = sample // SHUFFLE_SHARD_SAMPLES
            first[shard], last[shard] = min(first[shard], position), max(last[shard], position)
        batches = [samples[start:start + SHUFFLE_BATCH] for start in range(0, size, SHUFFLE_BATCH)]
        measured[label] = {
            "spread": sum(high - low for low, high in zip(first, last, strict=True)) / SHUFFLE_SHARDS / size,
            "shards_per_batch": sum(len({sample // SHUFFLE_SHARD_SAMPLES for sample in batch})
                                    for batch in batches) / len(batches)}
    return measured


def _shuffle_rows(measured: dict[str, dict[str, float]]) -> list[Row]:
    full = measured["full shuffle (map-style)"]
    return [Row(f"shuffle, {label}: distinct shards in a global batch / a full shuffle's", value["shards_per_batch"]
                / full["shards_per_batch"],
                notes=f"{value['shards_per_batch']:.1f} against {full['shards_per_batch']:.1f} shards per batch of "
                      f"{SHUFFLE_BATCH}; a shard's samples spread over {value['spread']:.1%} of the epoch (a full "
                      f"shuffle: {full['spread']:.1%}); {SHUFFLE_SHARDS} shards of {SHUFFLE_SHARD_SAMPLES} samples, "
                      f"computed from the order alone")
            for label, value in measured.items() if value is not full]


# -- the peers ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    package: str  # on PyPI
    version: str
    module: str  # what it imports as
    label: str


PEERS = {"streaming": Peer("mosaicml-streaming", "0.13.0", "streaming", "MosaicML Streaming"),
         "litdata": Peer("litdata", "0.2.76", "litdata", "LitData")}
# Their environments, made once and kept: a first full run spends a minute or two making each.
PEER_ENVIRONMENTS = Path.home() / ".cache" / "ddp-deploy" / "bench-peers"
PEER_CHUNK_BYTES = 4_000_000  # their shards (MDS shards, litdata chunks) as large as the streaming shards
PIP_TIMEOUT_S = 900
_PEER_REQUIREMENTS = """import importlib.metadata, re, sys
for requirement in importlib.metadata.requires(sys.argv[1]) or []:
    name = re.split(r"[ <>=!~;(\\[]", requirement, maxsplit=1)[0].lower()
    if "extra ==" not in requirement and name not in ("torch", "torchvision"):
        print(requirement)"""


def _peer_environment(peer: Peer) -> Path:
    """The Python of the peer's own virtual environment: the peer and its requirements from PyPI (their pins conflict
    with this project's: MosaicML Streaming's numpy<2.2), but torch and torchvision, taken from this environment by a
    .pth line after the peer's own packages, so that every side trains with the same torch build. Made once, in
    PEER_ENVIRONMENTS; BenchError with pip's words where it cannot be."""
    folder = PEER_ENVIRONMENTS / f"{peer.package}-{peer.version}-py{sys.version_info[0]}{sys.version_info[1]}"
    python, ready = folder / "bin" / "python", folder / "ready"
    if ready.is_file():
        return python
    print(f"[bench] making {peer.package} {peer.version}'s environment in {folder} (once) ...", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    run_command([sys.executable, "-m", "venv", str(folder)], TIMEOUT_S)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    run_command([*pip, "--no-deps", f"{peer.package}=={peer.version}"], PIP_TIMEOUT_S)
    requirements = run_command([str(python), "-c", _PEER_REQUIREMENTS, peer.package], TIMEOUT_S).stdout
    run_command([*pip, *requirements.splitlines()], PIP_TIMEOUT_S)
    site = run_command([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], TIMEOUT_S)
    Path(site.stdout.strip(), "zz-ddp-deploy-torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run_command([str(python), "-c", f"import torch, torchvision, {peer.module}"], TIMEOUT_S)
    ready.touch()
    return python


def _peer_datasets(ctx: Context, server: S3Server, images: Path) -> tuple[dict[str, tuple[Path, str]], dict[str, str]]:
    """Each peer's Python and the URL of the training images written in its own format, by name; and why, for each
    peer that could not be made ready."""
    train, _, _ = load_imagefolder(images, SIZE, 0.1, 0)  # the split and order ddp-shard writes
    manifest = ctx.scratch("streamed-shards-peers") / "train.json"
    manifest.write_text(json.dumps([[path, int(label)] for path, label in zip(train.files, train.labels.tolist(),
                                                                               strict=True)]))
    ready, unavailable = {}, {}
    for name, peer in PEERS.items():
        try:
            python = _peer_environment(peer)
        except BenchError as error:
            unavailable[name] = f"could not install {peer.package} {peer.version}: {str(error)[-300:]}"
            continue
        url = f"s3://{server.new_bucket()}/{name}"
        try:
            run_command([str(python), "-m", __name__, "peer-write", name, str(manifest), url], TIMEOUT_S,
                        env=_peer_env(server))
        except BenchError as error:
            unavailable[name] = f"could not write its dataset: {str(error)[-300:]}"
            continue
        ready[name] = (python, url)
    return ready, unavailable


def _peer_env(server: S3Server) -> dict[str, str]:
    return {**server.env, "S3_ENDPOINT_URL": server.endpoint}  # MosaicML Streaming's name for the endpoint


def _peer_epoch(python: Path, name: str, url: str, work: Path, server: S3Server, steps: int, log_every: int) -> float:
    """The peer's loop (_peer_train) at 2 ranks under torchrun: the median samples/s of its windows, the first left
    out."""
    out = work / f"peer-{name}.json"
    run_command([str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}", "-m",
                 __name__, "peer-train", name, url, str(out), str(steps), str(log_every), str(work / f"peer-{name}")],
                TIMEOUT_S, env=_peer_env(server))
    return median(json.loads(out.read_text())[1:])


def _peer_rows(rounds: list[dict[str, Any]], unavailable: dict[str, str], quick: bool) -> list[Row]:
    rows = []
    for name, peer in PEERS.items():
        measure = f"epoch from streaming shards: the trainer / {peer.label} {peer.version} (samples/s)"
        if quick or name in unavailable:
            reason = "quick mode leaves the peers out" if quick else unavailable[name]
            rows.append(Row(measure, None, PEER_GOAL, notes=f"not measured ({reason})"))
            continue
        mine, theirs = [r["epoch_streaming"]["samples_per_s"] for r in rounds], [r[f"peer_{name}"] for r in rounds]
        ratio = paired_ratio(mine, theirs)
        rows.append(Row(measure, ratio.median, PEER_GOAL, spread=ratio.spread,
                        notes=f"{median(mine):,.0f} against {median(theirs):,.0f} samples/s; the same JPEG bytes in "
                              f"its own format ({PEER_CHUNK_BYTES / 1e6:.0f} MB shards) on the same server, its own "
                              f"loader and shuffle, the same ConvNet, batch, DDP, {WORKERS} worker per rank and "
                              f"windows"))
    return rows


# -- what runs in a peer's environment (python -m bench.figures.streamed_shards peer-write|peer-train ...) ---------


def _peer_main(argv: list[str]) -> int:
    if argv[:1] == ["peer-write"]:
        name, manifest, url = argv[1:]
        samples = [(path, label) for path, label in json.loads(Path(manifest).read_text())]
        _write_peer_dataset(name, samples, url)
    elif argv[:1] == ["peer-train"]:
        name, url, out, steps, log_every, cache = argv[1:]
        _peer_train(name, url, Path(out), int(steps), int(log_every), Path(cache))
    else:
        print(f"usage: python -m {__name__} peer-write NAME MANIFEST URL | peer-train NAME URL OUT STEPS LOG_EVERY "
              f"CACHE (the suite runs it: python -m bench.run --only shards)", file=sys.stderr)
        return 2
    return 0


def _peer_sample(sample: tuple[str, int]) -> dict[str, Any]:
    """A training image as both peers store it: the JPEG file's bytes as they are, and its class."""
    path, label = sample
    return {"jpg": Path(path).read_bytes(), "cls": label}


def _write_peer_dataset(name: str, samples: list[tuple[str, int]], url: str) -> None:
    if name == "streaming":
        from streaming import MDSWriter

        with MDSWriter(out=url, columns={"jpg": "bytes", "cls": "int"}, size_limit=PEER_CHUNK_BYTES) as writer:
            for sample in samples:
                writer.write(_peer_sample(sample))
    else:
        import litdata

        _litdata_over_http()
        litdata.optimize(fn=_peer_sample, inputs=samples, output_dir=url, chunk_bytes=PEER_CHUNK_BYTES, num_workers=1,
                         verbose=False)


def _litdata_over_http() -> None:
    """LitData moves chunks through obstore, whose client refuses a plain-http endpoint (the S3 server here, on
    loopback) unless told otherwise, and LitData gives it no way to be told: add obstore's own allow_http to the
    client options LitData builds its stores with (the path it takes against AWS over https, not its slower boto3
    fallback)."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"  # type: ignore[index]


def _peer_train(name: str, url: str, out: Path, steps: int, log_every: int, cache: Path) -> None:
    """One rank of the peer's loop: its streaming dataset and loader over the images, decoded as the trainer decodes
    them, into the trainer's ConvNet under DDP (gloo, one thread), fused AdamW, normalised after the batch is made as
    the trainer does; every ``log_every`` steps the window's samples/s of all ranks, which rank 0 writes to ``out``."""
    import io

    import torch
    import torch.distributed as dist
    from torch import nn

    from trainer.data import IMAGENET_MEAN, IMAGENET_STD, Normalise, decode_image
    from trainer.models import build_model

    def decoded(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        return decode_image(io.BytesIO(sample["jpg"]), SIZE, "a jpg member"), int(sample["cls"])

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    batch = GLOBAL_BATCH // dist.get_world_size()
    loader: Any
    if name == "streaming":
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        class MosaicImages(StreamingDataset):
            def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
                return decoded(super().__getitem__(index))

        clean_stale_shared_memory()
        dataset = MosaicImages(remote=url, local=str(cache), shuffle=True, shuffle_seed=0, batch_size=batch)
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch, num_workers=WORKERS, drop_last=True)
    else:
        import litdata

        _litdata_over_http()

        class LitImages(litdata.StreamingDataset):
            def __getitem__(self, index: Any) -> tuple[torch.Tensor, int]:
                return decoded(super().__getitem__(index))

        dataset = LitImages(url, cache_dir=str(cache), shuffle=True, seed=0, drop_last=True)
        loader = litdata.StreamingDataLoader(dataset, batch_size=batch, num_workers=WORKERS)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(build_model("convnet", 3, (SIZE, SIZE), CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    normalise = Normalise(IMAGENET_MEAN, IMAGENET_STD)
    windows: list[float] = []
    totals = torch.zeros(3)  # loss sum, correct, samples: read at the log steps only
    step, started = 0, time.perf_counter()
    while step < steps:
        for images, labels in loader:
            outputs = model(normalise(images))
            loss = nn.functional.cross_entropy(outputs, labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            totals += torch.stack([loss.detach() * len(labels), (outputs.argmax(1) == labels).sum(),
                                   torch.tensor(float(len(labels)))])
            step += 1
            if step % log_every == 0:
                dist.all_reduce(totals)
                windows.append(float(totals[2]) / (time.perf_counter() - started))
                totals.zero_()
                started = time.perf_counter()
            if step == steps:
                break
    if dist.get_rank() == 0:
        out.write_text(json.dumps(windows))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(_peer_main(sys.argv[1:]))
