"""A sharded dataset on a local folder and on a real S3-compatible server (moto, loopback): written by ddp-shard's
writer or indexed from plain WebDataset tars, read back sample for sample; and each bad input as one DataError that
names the file and the fix: an index that does not match its shards, a shard that is missing, truncated or corrupt
mid-epoch, a full cache disk, a store that stops answering (retried, then exit 200), credentials kept out."""

from __future__ import annotations

import io
import tarfile
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.support.mounts import mount_tmpfs
from tests.support.s3_server import S3Server
from trainer.data.shards import RetryPolicy, ShardedDataset
from trainer.data.shards.cli import main as ddp_shard
from trainer.data.shards.order import Piece
from trainer.data.shards.writer import ShardWriter, write_dataset
from trainer.errors import EXIT_PEER_LOST, DataError, DataUnavailable


def numbers(url: str, count: int = 30, per_shard: int = 7) -> None:
    writer = ShardWriter(url, 1 << 30)
    for sample in range(count):
        writer.add("train", f"{sample:04d}", {"txt": str(sample).encode(), "cls": str(sample % 3).encode()})
        if sample % per_shard == per_shard - 1:
            writer._flush("train")
    writer.close({"num_classes": 3})


def opened(url: str, cache: Path, **retry: float) -> ShardedDataset:
    dataset = ShardedDataset(url, "train", lambda members: int(members["txt"]), RetryPolicy(**retry) if retry else None)
    dataset.attach_cache(cache, "train-rank0")
    return dataset


def test_written_samples_read_back_in_index_order_from_a_folder(tmp_path):
    numbers(str(tmp_path / "data"))
    dataset = opened(str(tmp_path / "data"), tmp_path / "cache")
    assert len(dataset) == 30 and dataset.counts == [7, 7, 7, 7, 2]
    assert [dataset[i] for i in range(30)] == list(range(30))


def test_plain_webdataset_tars_are_indexed_in_place_and_their_classes_counted(tmp_path):
    folder = tmp_path / "wds"
    folder.mkdir()
    for shard in range(2):
        with tarfile.open(folder / f"train-{shard}.tar", "w") as tar:  # GNU format, as `tar` and webdataset write
            for sample in range(5):
                key = f"images/s{shard}_{sample}"
                for extension, data in (("jpg", bytes([sample]) * 300), ("cls", str(sample).encode()),
                                        ("json", b"{}")):
                    info = tarfile.TarInfo(f"{key}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    assert ddp_shard(["index", str(folder)]) == 0
    dataset = ShardedDataset(str(folder), "train")
    dataset.attach_cache(tmp_path / "cache", "train-rank0")
    assert dataset.info["num_classes"] == 5 and len(dataset) == 10
    assert dataset[7] == {"jpg": bytes([2]) * 300, "cls": b"2", "json": b"{}"}


def test_any_map_style_dataset_is_written_with_the_default_image_encoding(tmp_path):
    images = [(torch.full((1, 4, 4), value, dtype=torch.uint8), value % 2) for value in range(6)]
    index = write_dataset({"train": images, "eval": images[:2]}, str(tmp_path / "out"), info={"num_classes": 2})
    assert {split: sum(e.samples for e in entries) for split, entries in index.splits.items()} == {"train": 6,
                                                                                                  "eval": 2}


def test_an_index_that_does_not_match_its_shards_is_refused_at_start(tmp_path):
    data = tmp_path / "data"
    numbers(str(data))
    (data / "train-000001.tar").unlink()
    with (data / "train-000002.tar").open("ab") as shard:
        shard.write(b"\0" * 512)
    with pytest.raises(DataError) as refused:
        ShardedDataset(str(data))
    message = str(refused.value)
    assert "does not match the shards beside it" in message and "train-000001.tar" in message
    assert "train-000002.tar (20992 bytes, listed 20480)" in message and "ddp-shard index" in message


def test_a_folder_without_an_index_says_how_to_make_one(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"index.json: not found \(the store answered 404\)"):
        ShardedDataset(str(tmp_path / "empty"))


def test_a_shard_deleted_truncated_or_corrupted_mid_epoch_names_it(tmp_path):
    data = tmp_path / "data"
    numbers(str(data))
    dataset = opened(str(data), tmp_path / "cache")
    (data / "train-000000.tar").unlink()
    with pytest.raises(DataError, match=r"train-000000.tar: not found \(the store answered 404\)"):
        dataset.fetch(0, Piece(0, 0, 7))
    shard = data / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:2048])
    with pytest.raises(DataError, match=r"train-000001.tar: truncated: 2048 of the 14336 bytes at offset 0 that "
                                        r"its index lists"):
        dataset.fetch(8, Piece(1, 0, 7))
    shard = data / "train-000002.tar"
    damaged = bytearray(shard.read_bytes())
    damaged[3 * 1024 + 1] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    with pytest.raises(DataError, match=r"train-000002.tar: sample 0015 \(bytes 2048..4096\) does not match its "
                                        r"CRC-32 .* fetched twice: the shard is corrupt"):
        dataset.fetch(16, Piece(2, 0, 7))
    assert dataset.fetch(22, Piece(3, 0, 7)) == 22  # the others read on


def test_a_full_cache_disk_is_one_line_naming_the_folder(tmp_path, mount_point):
    data = tmp_path / "data"
    writer = ShardWriter(str(data), 1 << 30)
    writer.add("train", "0000", {"bin": b"\1" * 200_000})
    writer.close({})
    mount_tmpfs("size=64k", mount_point)
    dataset = opened(str(data), mount_point)
    with pytest.raises(DataError, match=r"the shard cache .* is full \(0 MB free\) writing 0.2 MB of shard "
                                        r"train-000000.tar; free space there"):
        dataset.fetch(0, Piece(0, 0, 1))


@pytest.fixture
def s3_data(s3_env: S3Server) -> str:
    url = f"s3://{s3_env.new_bucket()}/numbers"
    numbers(url)
    return url


def test_a_store_that_stops_answering_for_a_moment_is_retried(s3_env, s3_data, tmp_path):
    dataset = opened(s3_data, tmp_path / "cache", attempts=6, first_backoff_s=0.2, request_timeout_s=1.0)
    results: list[int] = []
    reader = threading.Thread(target=lambda: results.append(dataset.fetch(0, Piece(0, 0, 7))))
    with s3_env.stopped():
        started = time.monotonic()
        reader.start()
        time.sleep(2.5)  # the outage: longer than two attempts' timeouts
    reader.join(timeout=30)
    assert results == [0] and time.monotonic() - started >= 2.5


def test_a_store_that_keeps_failing_ends_the_run_to_be_restarted(s3_env, s3_data, tmp_path):
    dataset = opened(s3_data, tmp_path / "cache", attempts=2, first_backoff_s=0.1, request_timeout_s=1.0)
    with s3_env.stopped(), pytest.raises(DataUnavailable) as failed:
        dataset.fetch(0, Piece(0, 0, 7))
    assert failed.value.exit_code == EXIT_PEER_LOST
    assert "the store kept failing" in str(failed.value) and "through 2 attempts" in str(failed.value)


def test_credentials_in_a_data_url_never_reach_a_message(tmp_path):
    with pytest.raises(DataError) as failed:
        ShardedDataset("http://alice:S3cret@127.0.0.1:9/data?sig=T0ken", retry=RetryPolicy(attempts=1))
    assert "S3cret" not in str(failed.value) and "T0ken" not in str(failed.value)
