"""Writing a sharded dataset (``ddp-shard`` and the Python API): tar shards of about a target size, each with its
index, and the dataset's index.json written last, so that a dataset whose writing stopped half-way is refused
("no index.json") rather than read in part. Existing WebDataset shards are indexed in place (``index_shards``).

    from trainer.data.shards.writer import write_dataset

    write_dataset({"train": my_train_set, "eval": my_eval_set}, "s3://bucket/data", encode=my_encode,
                  info={"num_classes": 10})

``encode(item)`` returns the sample's members by extension (``{"npy": ..., "cls": b"3"}``); the default,
``encode_image_item``, takes (image tensor, class) items and writes a PNG and a ``.cls``.
"""

from __future__ import annotations

import fnmatch
import io
import logging
import posixpath
import tarfile
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from trainer.data.shards.layout import INDEX_NAME, DatasetIndex, ShardEntry, scan_tar
from trainer.data.shards.store import ShardStore
from trainer.errors import DataError, described

__all__ = ["DEFAULT_SHARD_MB", "ShardWriter", "encode_image_item", "index_shards", "write_dataset"]

log = logging.getLogger(__name__)
DEFAULT_SHARD_MB = 64.0  # object stores serve such objects at full speed; a node holds a few per lane


class ShardWriter:
    """Samples in, shards out: one split at a time or interleaved; ``close(info)`` writes index.json."""

    def __init__(self, url: str, shard_bytes: int) -> None:
        if shard_bytes < 1024:
            raise DataError(f"shard size {shard_bytes} bytes: give at least 1 KB (--shard-mb)")
        self.store = ShardStore(url)
        self.shard_bytes = shard_bytes
        self.splits: dict[str, list[ShardEntry]] = {}
        self._open: dict[str, tuple[tarfile.TarFile, io.BytesIO, set[str]]] = {}

    def add(self, split: str, key: str, members: Mapping[str, bytes]) -> None:
        if not members:
            raise DataError(f"sample {key}: no members to write")
        if "." in posixpath.basename(key) or key.startswith("__"):
            raise DataError(f"sample key {key!r}: keys may not hold a '.' in their last part nor start with '__' "
                            f"(WebDataset's rule: the key ends at the first dot)")
        tar, buffer, keys = self._open.get(split) or self._new(split)
        if key in keys:
            raise DataError(f"sample key {key!r} twice in one shard of split {split}")
        keys.add(key)
        for extension, data in members.items():
            info = tarfile.TarInfo(f"{key}.{extension}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644  # no time: the same data writes the same bytes
            tar.addfile(info, io.BytesIO(data))
        if buffer.tell() >= self.shard_bytes:
            self._flush(split)

    def _new(self, split: str) -> tuple[tarfile.TarFile, io.BytesIO, set[str]]:
        buffer = io.BytesIO()
        tar = tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115 - closed by _flush
        opened = (tar, buffer, set[str]())
        self._open[split] = opened
        return opened

    def _flush(self, split: str) -> None:
        tar, buffer, _ = self._open.pop(split)
        tar.close()
        data = buffer.getvalue()
        name = f"{split}-{len(self.splits.setdefault(split, [])):06d}.tar"
        self.splits[split].append(self._put(name, data))

    def _put(self, name: str, data: bytes) -> ShardEntry:
        index, crc, _ = scan_tar(io.BytesIO(data), name)
        sidecar = index.to_json().encode()
        self._write(name, data)
        self._write(name + ".idx.json", sidecar)
        log.info("wrote %s: %d samples, %.1f MB", self.store.where(name), len(index.samples), len(data) / 1e6)
        return ShardEntry(name, len(index.samples), len(data), crc, zlib.crc32(sidecar))

    def _write(self, name: str, data: bytes) -> None:
        try:
            fs, root = self.store._filesystem()
            if "://" not in self.store.url:
                fs.makedirs(root, exist_ok=True)
            fs.pipe_file(posixpath.join(root, name), data)
        except DataError:
            raise
        except Exception as error:  # noqa: BLE001 - each store has its own errors
            raise DataError(f"{self.store.where(name)}: cannot write it ({described(error)}); check the URL, the "
                            f"credentials and the space there") from None

    def close(self, info: Mapping[str, Any]) -> DatasetIndex:
        for split in list(self._open):
            self._flush(split)
        index = DatasetIndex(self.splits, dict(info))
        self._write(INDEX_NAME, index.to_json().encode())
        return index


def encode_image_item(item: Any) -> dict[str, bytes]:
    """(uint8 [C,H,W] image tensor, class) -> a PNG (lossless: the trained pixels are the dataset's) and a .cls."""
    from PIL import Image

    image, label = item
    if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or image.dim() != 3:
        raise DataError(f"encode_image_item takes (uint8 [C,H,W] tensor, class) items, got "
                        f"{type(image).__name__} {getattr(image, 'dtype', '')} {list(getattr(image, 'shape', []))}; "
                        f"pass encode= for other items")
    array = image.permute(1, 2, 0).numpy()
    picture = Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG", compress_level=1)
    return {"png": buffer.getvalue(), "cls": str(int(label)).encode()}


def write_dataset(splits: Mapping[str, Iterable[Any]], url: str, encode: Callable[[Any], Mapping[str, bytes]] =
                  encode_image_item, info: Mapping[str, Any] | None = None,
                  shard_mb: float = DEFAULT_SHARD_MB) -> DatasetIndex:
    """Every item of each split (a map-style dataset, or any iterable) as shards at ``url``, keys in order."""
    writer = ShardWriter(url, int(shard_mb * 1e6))
    for split, items in splits.items():
        for number, item in enumerate(items):
            writer.add(split, f"{number:09d}", encode(item))
    return writer.close(info or {})


def index_shards(url: str, patterns: Mapping[str, str], info: Mapping[str, Any] | None = None) -> DatasetIndex:
    """Index existing WebDataset shards at ``url``: each split's tar files matching its glob (in name order) are
    read once, their indexes written beside them, and index.json last. ``num_classes`` is counted from the .cls
    members when ``info`` does not give it."""
    store = ShardStore(url)
    writer = ShardWriter(url, 1 << 30)
    names = sorted(store.sizes())
    largest = -1
    for split, pattern in patterns.items():
        matched = [name for name in names if fnmatch.fnmatch(name, pattern) and name.endswith(".tar")]
        if not matched:
            raise DataError(f"{store.shown}: no tar files match {pattern!r} for split {split}")
        entries = writer.splits.setdefault(split, [])
        for name in matched:
            with store.open(name) as stream:
                shard_index, crc, labels = scan_tar(stream, name)
            sidecar = shard_index.to_json().encode()
            writer._write(name + ".idx.json", sidecar)
            entries.append(ShardEntry(name, len(shard_index.samples), shard_index.bytes, crc, zlib.crc32(sidecar)))
            for value in labels.values():
                try:
                    largest = max(largest, int(value.decode().strip()))
                except (UnicodeDecodeError, ValueError):
                    raise DataError(f"{store.where(name)}: a .cls member holds {value[:20]!r}, not a class index"
                                    ) from None
            log.info("indexed %s: %d samples", store.where(name), len(shard_index.samples))
    details = dict(info or {})
    if "num_classes" not in details and largest >= 0:
        details["num_classes"] = largest + 1
    return writer.close(details)
