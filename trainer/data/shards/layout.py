"""What a sharded dataset is on the store: WebDataset's tar shards, and the index that makes them addressable.

    PREFIX/index.json                  the dataset: its splits, each a list of shards with sample counts, sizes
                                       and checksums, and what the data is (classes, image size)
    PREFIX/train-000000.tar            a shard: tar members KEY.EXT, a sample's members one after another
    PREFIX/train-000000.tar.idx.json   the shard's own index: each sample's byte span, CRC-32 and members

A shard is plain WebDataset (``webdataset``, ``tar tf`` and any tar reader read it). The dataset index holds one
entry per shard, so a rank knows the whole epoch's order from it alone (O(shards) memory); a shard's own index
(O(its samples)) is read only by the ranks that read that shard, and says where each sample's bytes are, so that
a rank fetches only the byte range of the samples it trains (an HTTP range request) and checks each sample's
CRC-32 as it arrives.
"""

from __future__ import annotations

import json
import posixpath
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from trainer.errors import DataError

__all__ = ["FORMAT", "INDEX_NAME", "VERSION", "DatasetIndex", "ShardEntry", "ShardIndex", "SampleSpan",
           "scan_tar", "split_member"]

FORMAT = "ddp-deploy-shards"
VERSION = 1
INDEX_NAME = "index.json"
SIDECAR_SUFFIX = ".idx.json"
BLOCK = 512  # tar's block: headers and the padding after each member's data


def split_member(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the file name, the extension the rest."""
    folder, base = posixpath.split(name)
    stem, dot, extension = base.partition(".")
    return posixpath.join(folder, stem), extension.lower() if dot else ""


@dataclass
class SampleSpan:
    key: str
    start: int  # byte offset of its first member's header in the shard
    end: int  # byte offset after its last member's data and padding
    crc32: int  # of the bytes start..end
    members: list[tuple[str, int, int]]  # (extension, data offset in the shard, size)


@dataclass
class ShardIndex:
    """One shard's own index (``NAME.idx.json``)."""

    shard: str
    bytes: int
    samples: list[SampleSpan]

    def to_json(self) -> str:
        rows = [[s.key, s.start, s.end, s.crc32, [list(member) for member in s.members]] for s in self.samples]
        return json.dumps({"format": FORMAT, "version": VERSION, "shard": self.shard, "bytes": self.bytes,
                           "samples": rows}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: bytes | str, where: str) -> ShardIndex:
        try:
            value = json.loads(text)
            _check_format(value, where)
            samples = [SampleSpan(key, start, end, crc, [(ext, offset, size) for ext, offset, size in members])
                       for key, start, end, crc, members in value["samples"]]
            return cls(value["shard"], int(value["bytes"]), samples)
        except DataError:
            raise
        except (ValueError, KeyError, TypeError) as error:
            raise DataError(f"{where}: not a shard index ({type(error).__name__}: {error}); rebuild it with "
                            f"ddp-shard index") from None


@dataclass
class ShardEntry:
    """A shard as the dataset index lists it."""

    name: str  # relative to the dataset's prefix
    samples: int
    bytes: int
    crc32: int  # of the whole shard
    sidecar_crc32: int  # of its index file's bytes

    @property
    def sidecar(self) -> str:
        return self.name + SIDECAR_SUFFIX


@dataclass
class DatasetIndex:
    splits: dict[str, list[ShardEntry]]
    info: dict[str, Any] = field(default_factory=dict)  # what the data is: classes, channels, image size

    def split(self, name: str, where: str) -> list[ShardEntry]:
        if name not in self.splits or not self.splits[name]:
            held = ", ".join(f"{split} ({len(shards)} shards)" for split, shards in self.splits.items()) or "none"
            raise DataError(f"{where}: no shards of split {name!r} in its {INDEX_NAME} (it holds {held}); write them "
                            f"with ddp-shard, or index them with ddp-shard index --split {name}")
        return self.splits[name]

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "info": self.info,
                           "splits": {name: [asdict(entry) for entry in entries]
                                      for name, entries in self.splits.items()}}, indent=1)

    @classmethod
    def from_json(cls, text: bytes | str, where: str) -> DatasetIndex:
        try:
            value = json.loads(text)
            _check_format(value, where)
            splits = {name: [ShardEntry(**entry) for entry in entries] for name, entries in value["splits"].items()}
        except DataError:
            raise
        except (ValueError, KeyError, TypeError) as error:
            raise DataError(f"{where}: not a shards index ({type(error).__name__}: {error}); write the dataset with "
                            f"ddp-shard, or index existing WebDataset shards with ddp-shard index") from None
        for name, entries in splits.items():
            for entry in entries:
                if entry.samples < 1 or entry.bytes < BLOCK:
                    raise DataError(f"{where}: shard {entry.name} of split {name} is listed with {entry.samples} "
                                    f"samples and {entry.bytes} bytes; rebuild the index with ddp-shard index")
        return cls(splits, dict(value.get("info") or {}))


def _check_format(value: Any, where: str) -> None:
    if not isinstance(value, dict) or value.get("format") != FORMAT:
        raise DataError(f"{where}: not a {FORMAT} index; write the dataset with ddp-shard, or index existing "
                        f"WebDataset shards with ddp-shard index")
    if value.get("version") != VERSION:
        raise DataError(f"{where}: index version {value.get('version')}, and this trainer reads version {VERSION}; "
                        f"rebuild it with this release's ddp-shard index")


class _Counting:
    """A forward-only reader that keeps a CRC-32 of every byte read, per sample span."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.position = 0
        self.total_crc = 0
        self.chunks: list[tuple[int, bytes]] = []  # (offset, bytes) since the last cut

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.chunks.append((self.position, data))
        self.total_crc = zlib.crc32(data, self.total_crc)
        self.position += len(data)
        return data

    def crc_of(self, start: int, end: int) -> int:
        """CRC-32 of bytes start..end (all read already, none before the last cut at or before start)."""
        crc = 0
        for offset, data in self.chunks:
            low, high = max(start, offset), min(end, offset + len(data))
            if low < high:
                crc = zlib.crc32(data[low - offset:high - offset], crc)
        return crc

    def cut(self, before: int) -> None:
        self.chunks = [(offset, data) for offset, data in self.chunks if offset + len(data) > before]


def scan_tar(stream: IO[bytes], name: str) -> tuple[ShardIndex, int, dict[str, bytes]]:
    """Read a tar shard front to back once: its index, the CRC-32 of all of it, and the members named *.cls*
    (the labels, so that an index can say how many classes there are). Regular files only; members whose key
    starts with ``__`` (WebDataset's metadata) are skipped."""
    counting = _Counting(stream)
    samples: list[SampleSpan] = []
    labels: dict[str, bytes] = {}
    current: SampleSpan | None = None
    seen: set[str] = set()
    try:
        with tarfile.open(fileobj=counting, mode="r|") as tar:  # type: ignore[call-overload]
            for member in tar:
                if not member.isfile():
                    continue
                key, extension = split_member(member.name)
                if posixpath.basename(key).startswith("__"):
                    continue
                end = member.offset_data + -(-member.size // BLOCK) * BLOCK
                if current is None or current.key != key:
                    if current is not None:
                        _close(current, counting)
                        samples.append(current)
                    if key in seen:
                        raise DataError(f"{name}: the members of sample {key} are not together (WebDataset's "
                                        f"layout keeps a sample's files one after another); write the shard again")
                    seen.add(key)
                    current = SampleSpan(key, member.offset, end, 0, [])
                current.members.append((extension, member.offset_data, member.size))
                current.end = end
                if extension == "cls":
                    file = tar.extractfile(member)
                    labels[key] = file.read() if file is not None else b""
        tail = counting.read()  # the end-of-archive blocks, so that the whole shard's CRC is of all its bytes
        del tail
    except tarfile.TarError as error:
        raise DataError(f"{name}: not a readable tar shard ({error}); write it again (ddp-shard) or replace it"
                        ) from None
    if current is not None:
        _close(current, counting)
        samples.append(current)
    if not samples:
        raise DataError(f"{name}: a tar shard with no samples (no regular KEY.EXT members)")
    return ShardIndex(posixpath.basename(name), counting.position, samples), counting.total_crc, labels


def _close(sample: SampleSpan, counting: _Counting) -> None:
    sample.crc32 = counting.crc_of(sample.start, sample.end)
    counting.cut(sample.end)


def iter_members(data: bytes, base: int, sample: SampleSpan) -> Iterator[tuple[str, bytes]]:
    """(extension, bytes) of each member of a sample, from a buffer holding the shard's bytes from ``base`` on."""
    for extension, offset, size in sample.members:
        yield extension, data[offset - base:offset - base + size]
