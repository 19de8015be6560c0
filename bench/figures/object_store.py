"""Figure 14: a checkpoint saved to an S3-compatible store (moto's server on loopback, reached through s3fs as AWS
or MinIO would be), against uploading the same bytes, measured in one run, interleaved, median of N rounds.

The checkpoint is files of equal size (one per rank, as a sharded save writes) plus its manifest:
  upload    each file put as one object, nothing else (what any save must pay);
  in place  the backend's write, the save as it is: the files written through their checksums straight into the
            save's own folder (step-N.<save>), the manifest last, which commits it; nothing moved;
  moved     the previous release's commit: the same files written into a temporary folder, then moved into place
            object by object, the manifest last (a move on S3 is a server-side copy of every object and a delete).
A loopback server copies in memory: against a real store, whose copies run at its internal bandwidth and are
billed as requests, a move costs more than here.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import IO, Any

from bench.harness.context import Context
from bench.harness.launch import environment
from bench.harness.measure import load_average
from bench.harness.results import FigureResult, Row
from devtools.s3_server import s3_server
from trainer.checkpoint import CheckpointStorage, open_storage

TITLE = "Checkpoints on an object store"


def _moved(storage: CheckpointStorage) -> CheckpointStorage:
    """The same store's backend as the previous release used it: a temporary folder moved into place (see the
    module's docstring)."""

    class Moved(type(storage)):  # type: ignore[misc] - the backend open_storage chose for the URL
        commits_in_place = False

    return Moved(storage.location)


def _writer(data: bytes) -> Callable[[IO[bytes]], None]:
    return lambda handle: handle.write(data)


def _manifest(files: dict[str, dict[str, Any]]) -> bytes:
    return repr(sorted(files)).encode()


def _upload(storage: Any, prefix: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        storage.fs.pipe_file(f"{prefix}/{name}", data)


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    file_count, file_bytes, rounds = ctx.pick(8, 2), ctx.pick(32 << 20, 1 << 20), ctx.pick(5, 2)
    files = {f"__{rank}_0.distcp": os.urandom(file_bytes) for rank in range(file_count)}
    times: dict[str, list[float]] = {"upload": [], "in_place": [], "moved": []}
    with s3_server() as server:
        bucket = server.new_bucket()
        with environment(server.env):  # s3fs (botocore) reads the endpoint and the credentials from there
            location = f"s3://{bucket}/ckpt"
            in_place = open_storage(location)  # the fsspec backend, as a save to s3:// opens it
            moved = _moved(in_place)
            for step in range(1, rounds + 1):
                times["upload"].append(_timed(partial(_upload, moved, f"{moved.root}/upload-{uuid.uuid4().hex[:8]}",
                                                      files)))
                writers = {name: _writer(data) for name, data in files.items()}
                times["moved"].append(_timed(partial(moved.write, f"step-{2 * step:08d}", writers, _manifest)))
                times["in_place"].append(_timed(partial(in_place.write, f"step-{2 * step + 1:08d}", writers,
                                                        _manifest)))
    ratio = {way: [spent / upload for spent, upload in zip(times[way], times["upload"], strict=True)]
             for way in ("in_place", "moved")}
    median = {way: statistics.median(values) for way, values in times.items()}
    total_mb = file_count * file_bytes / 1e6
    rows = [
        Row(f"save (its own folder, committed by the manifest) / upload of the same bytes ({file_count} files, "
            f"{total_mb:.0f} MB)", statistics.median(ratio["in_place"]),
            notes=f"in place {median['in_place']:.2f} s, upload {median['upload']:.2f} s, median of {rounds}",
            spread=(min(ratio["in_place"]), max(ratio["in_place"]))),
        Row(f"the previous release's save, moved into place / the upload ({file_count} files, {total_mb:.0f} MB)",
            statistics.median(ratio["moved"]),
            notes=f"moved {median['moved']:.2f} s: the move is a server-side copy of every object, by rank 0",
            spread=(min(ratio["moved"]), max(ratio["moved"]))),
    ]
    details = {"seconds": times, "files": file_count, "bytes_per_file": file_bytes,
               "load_average": [load_before, load_average()]}
    return FigureResult(14, "object-store", TITLE, rows, details)
