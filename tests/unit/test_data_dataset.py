"""The in-memory dataset, its batched access, and the synthetic dataset."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from trainer.build import first, loader_workers
from trainer.data import ImageTensorDataset, collate_batch, load_datasets
from trainer.data import synthetic as synthetic_module
from trainer.distributed import Runtime
from trainer.launchers import identity_from_env
from trainer.tasks import ClassificationOptions as Options

ONE_PROCESS = Runtime(identity_from_env({}), torch.device("cpu"), "gloo")


def small_dataset() -> ImageTensorDataset:
    images = torch.arange(6 * 2 * 3 * 3, dtype=torch.int64).remainder(256).to(torch.uint8).view(6, 2, 3, 3)
    return ImageTensorDataset(images, torch.arange(6), mean=(0.5, 0.25), std=(0.5, 0.1))


def test_getitem_normalises_each_channel_with_its_mean_and_std() -> None:
    dataset = small_dataset()
    image, label = dataset[4]
    expected = (dataset.images[4].float() / 255 - torch.tensor([0.5, 0.25]).view(2, 1, 1)) / torch.tensor(
        [0.5, 0.1]).view(2, 1, 1)
    assert image.dtype == torch.float32 and label.dtype == torch.int64 and int(label) == 4
    torch.testing.assert_close(image, expected)


def test_getitems_equals_stacking_getitem() -> None:
    dataset = small_dataset()
    indices = [5, 0, 3, 3]
    images, labels = dataset.__getitems__(indices)
    torch.testing.assert_close(images, torch.stack([dataset[i][0] for i in indices]))
    assert torch.equal(labels, torch.stack([dataset[i][1] for i in indices]))


def test_dataloader_batches_come_from_getitems_unchanged() -> None:
    dataset = small_dataset()
    loader = DataLoader(dataset, batch_size=4, collate_fn=collate_batch)
    batches = list(loader)
    assert [len(labels) for _, labels in batches] == [4, 2]
    torch.testing.assert_close(batches[0][0], dataset.__getitems__([0, 1, 2, 3])[0])


def test_dataset_and_collate_survive_pickling_for_worker_processes() -> None:
    dataset, collate = pickle.loads(pickle.dumps((small_dataset(), collate_batch)))
    assert collate is collate_batch
    torch.testing.assert_close(dataset[2][0], small_dataset()[2][0])


def test_mean_and_std_must_cover_every_channel() -> None:
    with pytest.raises(ValueError, match="mean and std need 2 values"):
        ImageTensorDataset(torch.zeros(1, 2, 3, 3, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64),
                           mean=(0.5,), std=(0.5,))


def synthetic(**overrides: object) -> tuple[ImageTensorDataset, ImageTensorDataset]:
    config = Options(dataset="synthetic", **overrides)  # type: ignore[arg-type]
    train, test, _ = load_datasets(config, ONE_PROCESS)
    return train, test


def test_synthetic_data_is_the_same_whatever_the_global_rng() -> None:
    torch.manual_seed(1)
    first_train, first_test = synthetic(synthetic_train_size=64, synthetic_test_size=32)
    torch.manual_seed(2)
    second_train, second_test = synthetic(synthetic_train_size=64, synthetic_test_size=32)
    assert torch.equal(first_train.images, second_train.images) and torch.equal(first_train.labels, second_train.labels)
    assert torch.equal(first_test.images, second_test.images)
    assert not torch.equal(first_train.images[:32], first_test.images)


def test_synthetic_generation_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(3)
    synthetic(synthetic_train_size=16, synthetic_test_size=16)
    after = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(1))


@pytest.mark.parametrize("shape", ["1,28,28", "3,20,36", "5,1,1"])
def test_synthetic_data_takes_any_shape(shape: str) -> None:
    config = Options(dataset="synthetic", synthetic_shape=shape, synthetic_train_size=40, synthetic_test_size=20,
                        synthetic_classes=4)
    train, test, info = load_datasets(config, ONE_PROCESS)
    c, h, w = (int(part) for part in shape.split(","))
    assert (info.in_channels, info.image_size, info.num_classes) == (c, (h, w), 4)
    assert train.images.shape == (40, c, h, w) and test.images.shape == (20, c, h, w)
    assert train.__getitems__([0, 1])[0].shape == (2, c, h, w)


def test_synthetic_classes_are_balanced_and_learnable() -> None:
    train, test = synthetic(synthetic_train_size=500, synthetic_test_size=200)
    assert train.labels.bincount().tolist() == [50] * 10
    torch.manual_seed(0)
    model = torch.nn.Linear(28 * 28, 10)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    images, labels = train.__getitems__(list(range(len(train))))
    for _ in range(30):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images.flatten(1)), labels).backward()
        optimizer.step()
    test_images, test_labels = test.__getitems__(list(range(len(test))))
    accuracy = (model(test_images.flatten(1)).argmax(1) == test_labels).float().mean().item()
    assert accuracy > 0.8  # chance is 0.1


def test_max_samples_keep_the_first_n_and_the_batched_lookup() -> None:
    full_train, full_test = synthetic()
    train, test = first(full_train, 100), first(full_test, 7)
    assert isinstance(train, ImageTensorDataset) and torch.equal(train.images, full_train.images[:100])
    assert len(test) == 7 and torch.equal(test.labels, full_test.labels[:7])
    items = [(torch.tensor([float(i)]), i) for i in range(10)]
    assert [x for _, x in first(items, 3)] == [0, 1, 2] and first(items, 0) is items  # any map-style dataset


def test_a_synthetic_dataset_is_generated_once_into_the_cache_and_read_back_the_same(tmp_path, monkeypatch,
                                                                                     caplog) -> None:
    made, generated = [], synthetic_module.make_synthetic

    def counting(*args: object) -> object:
        made.append(args)
        return generated(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(synthetic_module, "make_synthetic", counting)
    sizes = {"synthetic_shape": "3,6,5", "synthetic_train_size": 24, "synthetic_test_size": 8}
    first_train, first_test = synthetic(data_cache_dir=str(tmp_path), **sizes)
    again_train, again_test = synthetic(data_cache_dir=str(tmp_path), **sizes)
    (cache,) = tmp_path.iterdir()
    assert len(made) == 1 and re.fullmatch(r"synthetic-v2-torch[\d.a-z]+-3x6x5-10-24-8\.pt", cache.name), cache.name
    plain_train, plain_test = synthetic(**sizes)
    for dataset in (first_train, again_train):
        assert torch.equal(dataset.images, plain_train.images) and torch.equal(dataset.labels, plain_train.labels)
        assert (dataset.mean, dataset.std) == (plain_train.mean, plain_train.std)
    assert torch.equal(again_test.images, plain_test.images) and torch.equal(again_test.labels, plain_test.labels)
    synthetic(data_cache_dir=str(tmp_path), **{**sizes, "synthetic_train_size": 32})
    assert len(made) == 2  # other sizes: another file
    # A damaged file, or one whose tensors are not what its name says, is made again and replaced, never trusted.
    good = cache.read_bytes()
    for damaged in (good[:1000], good.replace(b"train_images", b"train_imageZ")):
        cache.write_bytes(damaged)
        again_train, _ = synthetic(data_cache_dir=str(tmp_path), **sizes)
        assert torch.equal(again_train.images, plain_train.images)
    assert len(made) == 4 and caplog.text.count(f"cached synthetic dataset {cache} is unusable") == 2
    synthetic(data_cache_dir=str(tmp_path), **sizes)
    assert len(made) == 4  # the file was replaced by a good one


def test_synthetic_statistics_match_a_direct_float_computation() -> None:
    train, _ = synthetic(synthetic_shape="3,9,7", synthetic_train_size=600, synthetic_test_size=4)
    as_float = train.images.double() / 255
    assert train.mean == pytest.approx(as_float.mean(dim=(0, 2, 3)).tolist(), rel=1e-12)
    assert train.std == pytest.approx(as_float.std(dim=(0, 2, 3)).tolist(), rel=1e-9)


@pytest.mark.parametrize(("cores", "local_ranks", "expected"),
                         [(2, 1, 1), (16, 1, 8), (16, 8, 1), (64, 1, 8), (96, 8, 6)])
def test_auto_loader_workers_are_one_per_two_cores_of_the_ranks_share_up_to_eight(monkeypatch, cores, local_ranks,
                                                                                   expected):
    """The GPU run found 4 (the old cap) decoding JPEG at under half of what an H100 trains from memory."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr("trainer.cores.CGROUP", Path("/nonexistent"))  # no container limit here
    assert loader_workers("auto", in_memory=False, local_world_size=local_ranks) == expected
    assert loader_workers("auto", in_memory=True, local_world_size=local_ranks) == 0
    assert loader_workers("3", in_memory=True, local_world_size=local_ranks) == 3


@pytest.mark.parametrize(("files", "expected"), [
    ({"cpu.max": "200000 100000\n"}, 2),  # cgroup v2: a pod's cpu: 2
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 cores: rounded up
    ({"cpu.max": "max 100000\n"}, 64),  # no limit
    ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 64),  # v1, no limit
    ({}, 64),  # no cgroup files at all
])
def test_usable_cores_are_the_affinitys_at_most_the_containers_cpu_limit(tmp_path, monkeypatch, files, expected):
    """A 2-CPU pod on a 64-core node sizes its threads and workers by 2 (the review of the GPU run's change)."""
    from trainer.cores import usable_cores

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    assert usable_cores(tmp_path) == expected
