"""Where data comes from: the default folder, the shipped subset, and fsspec URLs fetched into a cache."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from tests.support.data_files import write_idx_dataset
from tests.support.preconditions import unavailable
from trainer.data import default_data_dir, load_datasets
from trainer.data.catalog import IDX_FILES
from trainer.data.idx import read_idx
from trainer.data.locate import SHIPPED_FASHION_MNIST, SYSTEM_FASHION_MNIST, cache_folder
from trainer.distributed import Runtime
from trainer.errors import DataError
from trainer.launchers import identity_from_env
from trainer.tasks import ClassificationOptions as Options

ONE_PROCESS = Runtime(identity_from_env({}), torch.device("cpu"), "gloo")


def test_default_dir_is_the_debian_package_when_it_has_the_files(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path)
    assert default_data_dir("fashion-mnist", system_dir=tmp_path) == str(tmp_path)


def test_default_dir_is_the_shipped_subset_without_the_debian_package(tmp_path: Path) -> None:
    assert default_data_dir("fashion-mnist", system_dir=tmp_path / "absent") == str(SHIPPED_FASHION_MNIST)


def test_default_dir_of_synthetic_is_empty() -> None:
    assert default_data_dir("synthetic") == ""


@pytest.mark.parametrize("dataset", ["mnist", "cifar10"])
def test_other_datasets_need_a_data_dir(dataset: str) -> None:
    with pytest.raises(DataError, match=f"--dataset {dataset} needs --data-dir.*--download"):
        default_data_dir(dataset)


def test_shipped_subset_is_stratified_and_mixed() -> None:
    train, test, info = load_datasets(Options(data_dir=str(SHIPPED_FASHION_MNIST)), ONE_PROCESS)
    assert (len(train), len(test), info.name) == (5000, 1000, "fashion-mnist")
    assert train.labels.bincount().tolist() == [500] * 10 and test.labels.bincount().tolist() == [100] * 10
    assert len(set(train.labels[:50].tolist())) == 10  # --max-train-samples 50 still sees every class


def test_shipped_subset_holds_the_first_images_of_each_class_of_the_real_dataset() -> None:
    if not SYSTEM_FASHION_MNIST.is_dir():
        unavailable("needs the Debian package dataset-fashion-mnist (make data)")
    full_labels = read_idx(SYSTEM_FASHION_MNIST / "t10k-labels-idx1-ubyte.gz", 1)
    full_images = read_idx(SYSTEM_FASHION_MNIST / "t10k-images-idx3-ubyte.gz", 3)
    keep = np.sort(np.concatenate([np.flatnonzero(full_labels == c)[:100] for c in range(10)]))
    _, test, _ = load_datasets(Options(data_dir=str(SHIPPED_FASHION_MNIST)), ONE_PROCESS)
    assert torch.equal(test.images[:, 0], torch.from_numpy(full_images[keep]))


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A fresh folder on the memory:// filesystem, which lives as long as this process."""
    root = f"/data-test-{uuid.uuid4().hex}"
    yield f"memory://{root}"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def upload(local: Path, url: str) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    for file in local.rglob("*"):
        if file.is_file():
            fs.pipe(f"{root}/{file.relative_to(local).as_posix()}", file.read_bytes())


def test_memory_url_is_fetched_into_the_cache_and_read(tmp_path: Path, memory_url: str) -> None:
    arrays = write_idx_dataset(tmp_path / "source" / "FashionMNIST" / "raw")
    upload(tmp_path / "source", memory_url)
    config = Options(data_dir=memory_url, data_cache_dir=str(tmp_path / "cache"))
    train, test, _ = load_datasets(config, ONE_PROCESS)
    assert torch.equal(train.images[:, 0], torch.from_numpy(arrays["train-images-idx3-ubyte"]))
    assert sorted(p.name for p in cache_folder(memory_url, str(tmp_path / "cache")).iterdir()) == sorted(
        f"{name}.gz" for name in IDX_FILES)


def test_file_url_is_fetched_into_the_cache(tmp_path: Path) -> None:
    arrays = write_idx_dataset(tmp_path / "source", suffix="")
    url = (tmp_path / "source").as_uri()
    train, _, info = load_datasets(Options(dataset="mnist", data_dir=url, data_cache_dir=str(tmp_path / "c")),
                                   ONE_PROCESS)
    assert info.name == "mnist" and train.labels.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    assert cache_folder(url, str(tmp_path / "c")).is_dir()


def test_cached_files_of_the_right_size_are_not_fetched_again(tmp_path: Path, memory_url: str) -> None:
    write_idx_dataset(tmp_path / "source")
    upload(tmp_path / "source", memory_url)
    config = Options(data_dir=memory_url, data_cache_dir=str(tmp_path / "cache"))
    load_datasets(config, ONE_PROCESS)
    cached = {p.name: p.stat().st_ino for p in cache_folder(memory_url, config.data_cache_dir).iterdir()}
    load_datasets(config, ONE_PROCESS)
    assert {p.name: p.stat().st_ino for p in cache_folder(memory_url, config.data_cache_dir).iterdir()} == cached


def test_half_written_cache_from_a_crashed_fetch_is_replaced(tmp_path: Path, memory_url: str) -> None:
    write_idx_dataset(tmp_path / "source")
    upload(tmp_path / "source", memory_url)
    folder = cache_folder(memory_url, str(tmp_path / "cache"))
    folder.mkdir(parents=True)
    whole = (tmp_path / "source" / "train-images-idx3-ubyte.gz").read_bytes()
    (folder / "train-images-idx3-ubyte.gz").write_bytes(whole[: len(whole) // 2])
    (folder / ".train-labels-idx1-ubyte.gz.4242-0123abcd.part").write_bytes(b"partial")
    train, _, _ = load_datasets(Options(data_dir=memory_url, data_cache_dir=str(tmp_path / "cache")), ONE_PROCESS)
    assert len(train) == 40
    assert (folder / "train-images-idx3-ubyte.gz").read_bytes() == whole


def test_url_without_the_dataset_is_an_error_naming_it(tmp_path: Path, memory_url: str) -> None:
    fsspec.filesystem("memory").pipe(f"{memory_url.removeprefix('memory://')}/README", b"nothing here")
    with pytest.raises(DataError, match=f"--data-dir {memory_url}: no fashion-mnist files; expected "
                                        "train-images-idx3-ubyte.*upload the dataset there"):
        load_datasets(Options(data_dir=memory_url, data_cache_dir=str(tmp_path)), ONE_PROCESS)


def test_url_of_an_unknown_filesystem_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="--data-dir nosuchfs://bucket/data: no filesystem for this URL.*install"):
        load_datasets(Options(data_dir="nosuchfs://bucket/data", data_cache_dir=str(tmp_path)), ONE_PROCESS)


def test_download_into_a_url_is_refused(memory_url: str) -> None:
    with pytest.raises(DataError, match="--download writes into a local folder"):
        load_datasets(Options(data_dir=memory_url, download=True), ONE_PROCESS)


def test_each_url_has_its_own_readable_cache_folder() -> None:
    first, second = cache_folder("s3://bucket/fashion", "/c"), cache_folder("s3://bucket/fashion/", "/c")
    assert first != second and first.parent == Path("/c") and first.name.startswith("s3_bucket_fashion-")
    assert cache_folder("s3://bucket/fashion", "").parent == Path.home() / ".cache" / "ddp-deploy" / "data"
