"""The on-disk formats: IDX (plain and gzipped), CIFAR-10 python batches, torchvision's folder layouts."""

from __future__ import annotations

import gzip
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.data_files import write_cifar_dataset, write_idx_dataset
from trainer.data import load_datasets
from trainer.data.cifar import _reconstruct, read_batch
from trainer.data.idx import read_idx, read_images_and_labels, write_idx
from trainer.distributed import Runtime
from trainer.errors import DataError
from trainer.launchers import identity_from_env
from trainer.tasks import ClassificationOptions as Options

ONE_PROCESS = Runtime(identity_from_env({}), torch.device("cpu"), "gloo")


@pytest.mark.parametrize("suffix", [".gz", ""])
def test_idx_round_trip_plain_and_gzipped(tmp_path: Path, suffix: str) -> None:
    images = np.arange(3 * 5 * 7, dtype=np.uint8).reshape(3, 5, 7)
    path = tmp_path / f"images{suffix}"
    write_idx(path, images)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == (suffix == ".gz")
    np.testing.assert_array_equal(read_idx(path, 3), images)


def test_idx_bad_magic_number_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(b"<html>Not Found</html>" + bytes(100))
    with pytest.raises(DataError, match=f"{path}: not an IDX file with 3 dimension"):
        read_idx(path, 3)


def test_idx_labels_file_given_as_images_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "labels"
    write_idx(path, np.zeros(4, dtype=np.uint8))
    with pytest.raises(DataError, match="magic number 0x00000801, expected 0x00000803"):
        read_idx(path, 3)


@pytest.mark.parametrize(("cut", "problem"), [(-1, "truncated"), (2, "longer than its header says")])
def test_idx_length_must_match_header(tmp_path: Path, cut: int, problem: str) -> None:
    path = tmp_path / "train-images-idx3-ubyte"
    write_idx(path, np.zeros((2, 4, 4), dtype=np.uint8))
    raw = path.read_bytes()
    path.write_bytes(raw[:cut] if cut < 0 else raw + bytes(cut))
    with pytest.raises(DataError, match=f"{path}: {problem}: the header declares shape \\[2, 4, 4\\]"):
        read_idx(path, 3)


def test_truncated_gzip_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "train-images-idx3-ubyte.gz"
    write_idx(path, np.zeros((50, 28, 28), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(DataError, match=f"{path}: not a valid gzip file"):
        read_idx(path, 3)


def test_image_and_label_counts_must_match(tmp_path: Path) -> None:
    write_idx(images := tmp_path / "images", np.zeros((3, 28, 28), dtype=np.uint8))
    write_idx(labels := tmp_path / "labels", np.zeros(4, dtype=np.uint8))
    with pytest.raises(DataError, match=f"{images} holds 3 images but {labels} holds 4 labels"):
        read_images_and_labels(images, labels, num_classes=10)


def test_labels_beyond_the_classes_are_refused(tmp_path: Path) -> None:
    write_idx(images := tmp_path / "images", np.zeros((2, 28, 28), dtype=np.uint8))
    write_idx(labels := tmp_path / "labels", np.array([3, 10], dtype=np.uint8))
    with pytest.raises(DataError, match=f"{labels}: label 10 is outside 0..9"):
        read_images_and_labels(images, labels, num_classes=10)


def test_cifar_batches_read_in_their_published_format(tmp_path: Path) -> None:
    batches = write_cifar_dataset(tmp_path / "cifar-10-batches-py", per_batch=4)
    train, test, info = load_datasets(Options(dataset="cifar10", data_dir=str(tmp_path)), ONE_PROCESS)
    assert (info.in_channels, info.image_size, len(train), len(test)) == (3, (32, 32), 20, 4)
    first = batches["data_batch_1"]
    # Row layout of the files: 1024 red values, then green, then blue, each 32x32 row by row.
    expected = torch.from_numpy(first[b"data"][0].reshape(3, 32, 32).copy())
    assert torch.equal(train.images[0], expected)
    assert train.labels[:4].tolist() == first[b"labels"]
    assert test.labels.tolist() == batches["test_batch"][b"labels"]


def test_cifar_batch_pickled_by_python_3_also_reads(tmp_path: Path) -> None:
    path = tmp_path / "test_batch"
    data = np.arange(2 * 3072).astype(np.uint8).reshape(2, 3072)
    path.write_bytes(pickle.dumps({b"data": data, b"labels": [7, 1], b"filenames": [b"a.png", b"b.png"]}, protocol=2))
    images, labels = read_batch(path)
    assert torch.equal(images.flatten(1), torch.from_numpy(data)) and labels.tolist() == [7, 1]


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.makedirs, (str(self.marker),)


def test_cifar_reader_refuses_pickled_code(tmp_path: Path) -> None:
    marker = tmp_path / "was-run"
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": _RunsCode(marker), b"labels": []}, protocol=2))
    with pytest.raises(DataError, match=f"{path}: not a readable CIFAR-10 python batch .*refusing to load"):
        read_batch(path)
    assert not marker.exists()


class _HugeEmptyArray:
    """What numpy's own pickles never hold: _reconstruct asked for a shape that no bytes of the file back."""

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return _reconstruct, (np.ndarray, (3_000_000_000,), b"b")


def test_cifar_reader_refuses_an_array_larger_than_the_bytes_behind_it(tmp_path: Path) -> None:
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": _HugeEmptyArray(), b"labels": []}, protocol=2))
    assert path.stat().st_size < 200
    with pytest.raises(DataError, match=rf"{path}: not a readable CIFAR-10 python batch \(UnpicklingError: an "
                                        r"array of shape \[3000000000\] with no data behind it"):
        read_batch(path)


def test_cifar_batch_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 784), np.uint8), b"labels": [0, 1]}, protocol=2))
    with pytest.raises(DataError, match=rf"{path}: b'data' must be a uint8 array \[N, 3072\], found uint8 \[2, 784\]"):
        read_batch(path)


@pytest.mark.parametrize(("dataset", "subfolder", "suffix"), [
    ("fashion-mnist", "", ".gz"),
    ("fashion-mnist", "FashionMNIST/raw", ""),
    ("mnist", "MNIST/raw", ".gz"),
])
def test_idx_datasets_found_flat_or_in_torchvision_layout(tmp_path: Path, dataset: str, subfolder: str,
                                                          suffix: str) -> None:
    arrays = write_idx_dataset(tmp_path / subfolder, train_size=30, test_size=10, suffix=suffix)
    train, test, info = load_datasets(Options(dataset=dataset, data_dir=str(tmp_path)), ONE_PROCESS)
    assert info.name == dataset
    assert torch.equal(train.images[:, 0], torch.from_numpy(arrays["train-images-idx3-ubyte"]))
    assert test.labels.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()


def test_plain_file_preferred_over_gzipped_copy(tmp_path: Path) -> None:
    """torchvision keeps both after extracting; the plain one needs no decompression."""
    write_idx_dataset(tmp_path, suffix="")
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"damaged"))
    _, test, _ = load_datasets(Options(data_dir=str(tmp_path)), ONE_PROCESS)
    assert len(test) == 20


def test_missing_file_is_named(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path / "FashionMNIST" / "raw")
    (tmp_path / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="FashionMNIST/raw holds part of fashion-mnist but lacks t10k-labels-idx1"):
        load_datasets(Options(data_dir=str(tmp_path)), ONE_PROCESS)


def test_empty_folder_error_lists_the_files_and_suggests_download(tmp_path: Path) -> None:
    with pytest.raises(DataError) as caught:
        load_datasets(Options(dataset="cifar10", data_dir=str(tmp_path)), ONE_PROCESS)
    message = str(caught.value)
    assert f"--data-dir {tmp_path}: no cifar10 files" in message
    assert "data_batch_1" in message and f"{tmp_path}/cifar-10-batches-py" in message and "--download" in message


def test_nonexistent_folder_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=f"--data-dir {missing} does not exist"):
        load_datasets(Options(dataset="mnist", data_dir=str(missing)), ONE_PROCESS)
