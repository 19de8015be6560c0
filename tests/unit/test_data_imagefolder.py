"""--dataset imagefolder: torchvision's folder-per-class layout of real JPEG and PNG files, either split."""

from __future__ import annotations

import shutil
from pathlib import Path

import fsspec
import pytest
import torch

from tests.support.data_files import write_image_folder
from trainer.data import ImageFolderDataset, load_datasets
from trainer.distributed import Runtime
from trainer.errors import DataError
from trainer.launchers import identity_from_env
from trainer.tasks import ClassificationOptions as Options

ONE_PROCESS = Runtime(identity_from_env({}), torch.device("cpu"), "gloo")


def load(root: str, **options: object) -> tuple[ImageFolderDataset, ImageFolderDataset, object]:
    return load_datasets(Options(dataset="imagefolder", data_dir=root, image_size=16, **options),  # type: ignore[arg-type]
                         ONE_PROCESS, seed=3)


def test_one_folder_per_class_is_split_by_a_seeded_share_of_each_class(tmp_path):
    write_image_folder(tmp_path, {"cat": 10, "dog": 20, "emu": 5})
    train, test, info = load(str(tmp_path), eval_fraction=0.2)
    assert (info.num_classes, info.in_channels, info.image_size) == (3, 3, (16, 16))
    assert sorted(test.labels.tolist()) == [0, 0, 1, 1, 1, 1, 2]  # 20% of each class, at least one
    assert len(train) + len(test) == 35 and not set(train.files) & set(test.files)
    again_train, _, _ = load(str(tmp_path), eval_fraction=0.2)
    assert again_train.files == train.files  # the same seed, the same split and order
    assert len(set(train.labels[:6].tolist())) == 3, "classes interleaved: --max-train-samples sees them all"


def test_train_and_val_folders_are_the_split_and_name_the_classes(tmp_path):
    write_image_folder(tmp_path / "train", {"a": 4, "b": 4}, fmt="png")
    write_image_folder(tmp_path / "val", {"a": 2, "b": 1}, fmt="png")
    train, test, info = load(str(tmp_path))
    assert (len(train), len(test), info.num_classes) == (8, 3, 2)
    assert sorted(test.labels.tolist()) == [0, 0, 1]


def test_an_item_is_the_decoded_resized_cropped_normalised_image_and_its_label(tmp_path):
    write_image_folder(tmp_path, {"red": 3, "green": 3}, size=(20, 28))
    train, _, _ = load(str(tmp_path), eval_fraction=0.3)
    image, label = train[0]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32 and label.dtype == torch.int64
    assert image[int(label)].mean() > image[2].mean() + 1  # class k is bright in channel k, after normalising


def test_a_folder_without_class_folders_is_refused_with_the_layout(tmp_path):
    (tmp_path / "loose.jpg").write_bytes(b"")
    with pytest.raises(DataError, match="no class folders; an imagefolder holds one subfolder per class"):
        load(str(tmp_path))
    with pytest.raises(DataError, match="no such folder"):
        load(str(tmp_path / "absent"))
    with pytest.raises(DataError, match="needs --data-dir"):
        load("")


def test_an_unreadable_image_is_named_when_it_is_fetched(tmp_path):
    write_image_folder(tmp_path, {"a": 3, "b": 3})
    broken = tmp_path / "b" / "001.jpg"
    broken.write_bytes(b"not a jpeg at all")
    train, test, _ = load(str(tmp_path), eval_fraction=0.3)
    split = train if str(broken) in train.files else test
    with pytest.raises(DataError, match=rf"^{broken}: not a readable image \(.*\); replace or remove the file$"):
        split[split.files.index(str(broken))]
    with pytest.raises(DataError, match="no evaluation images; raise --eval-fraction"):
        load(str(tmp_path), eval_fraction=0.0)


def test_an_fsspec_url_is_copied_once_into_the_cache_and_read_from_there(tmp_path):
    write_image_folder(tmp_path / "source", {"a": 3, "b": 2})
    url = f"memory://images-{tmp_path.name}"
    fs = fsspec.filesystem("memory")
    for path in (tmp_path / "source").rglob("*.jpg"):
        fs.pipe_file(f"{url.removeprefix('memory://')}/{path.relative_to(tmp_path / 'source')}", path.read_bytes())
    train, test, _ = load(url, data_cache_dir=str(tmp_path / "cache"), eval_fraction=0.4)
    assert len(train) + len(test) == 5
    assert all(Path(file).is_relative_to(tmp_path / "cache") for file in train.files)
    shutil.rmtree(tmp_path / "source")
    first = Path(train.files[0]).stat().st_mtime_ns
    load(url, data_cache_dir=str(tmp_path / "cache"), eval_fraction=0.4)
    assert Path(train.files[0]).stat().st_mtime_ns == first, "files of the same size are not copied again"
