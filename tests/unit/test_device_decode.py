"""--image-decode device on the CPU (torchvision's libjpeg-turbo decoder standing in for nvJPEG): which JPEGs the
header sends to the device, the batch a worker hands over, the decoded batch against the workers' Pillow path,
and the bad inputs (a PNG or a CMYK JPEG among JPEGs, a JPEG the device decoder refuses, one nothing reads)."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import torch

from tests.support.data_files import jpeg_bytes, write_image_folder
from trainer.data.dataset import Normalise
from trainer.data.device_decode import DeviceDecode
from trainer.data.imagefolder import MEAN, STD, decode_image
from trainer.data.jpeg_bytes import JpegBytes, collate_for_device_decode, device_decodable, for_device
from trainer.data.shards.writer import write_dataset
from trainer.distributed import Runtime
from trainer.errors import ConfigError, DataError
from trainer.launchers import identity_from_env
from trainer.task import TaskContext
from trainer.tasks import ClassificationOptions, ImageClassification

CPU = torch.device("cpu")
ONE_PROCESS = Runtime(identity_from_env({}), CPU, "gloo")
NORMALISE = Normalise(MEAN, STD)
SIZE = 16


def workers_image(data: bytes, mode: str = "RGB", normalise: Normalise = NORMALISE) -> torch.Tensor:
    """What --image-decode workers trains on for these bytes (normalised)."""
    return normalise(decode_image(io.BytesIO(data), SIZE, "x", mode)[None])[0]


def worker_item(data: bytes, where: str, label: int = 0) -> tuple[JpegBytes | torch.Tensor, torch.Tensor]:
    return for_device(data, where) or decode_image(io.BytesIO(data), SIZE, where), torch.tensor(label)


def test_the_header_says_which_jpegs_the_device_decodes():
    baseline = jpeg_bytes(30, 24)
    assert device_decodable(baseline) and device_decodable(jpeg_bytes(30, 24, progressive=True))
    assert device_decodable(jpeg_bytes(30, 24, "L"))
    frame = baseline.index(b"\xff\xc0")
    arithmetic = baseline[:frame + 1] + b"\xc9" + baseline[frame + 2:]
    twelve_bit = baseline[:frame + 4] + b"\x0c" + baseline[frame + 5:]
    refused = {"cmyk": jpeg_bytes(30, 24, "CMYK"), "png": jpeg_bytes(30, 24, format="PNG"), "cut": baseline[:frame + 6],
               "arithmetic": arithmetic, "12-bit": twelve_bit, "text": b"not a jpeg at all", "empty": b""}
    assert [name for name, data in refused.items() if device_decodable(data)] == []
    assert for_device(refused["cmyk"], "c") is None and for_device(baseline, "b") == JpegBytes(baseline, "b")


def test_a_batch_of_jpegs_of_several_shapes_decodes_together_to_the_workers_images_within_rounding():
    files = [jpeg_bytes(30, 24, seed=1), jpeg_bytes(24, 30, seed=2), jpeg_bytes(64, 48, seed=3),
             jpeg_bytes(30, 24, seed=4), jpeg_bytes(SIZE, SIZE, seed=5), jpeg_bytes(40, 40, progressive=True, seed=6)]
    batch, labels = collate_for_device_decode([worker_item(data, f"f{n}", n) for n, data in enumerate(files)])
    assert batch.encoded.numel() == sum(map(len, files)) and batch.decoded is None
    assert labels.tolist() == list(range(6))
    decode = DeviceDecode(CPU, SIZE, False, NORMALISE)
    decoded = decode(batch)
    assert decoded.shape == (6, 3, SIZE, SIZE) and decoded.dtype == torch.float32
    assert torch.equal(decoded, decode(batch))  # the same bytes, the same pixels: what exact resume rests on
    # Resized a few at a time (a batch of large photos) or all at once: the same pixels.
    assert torch.equal(DeviceDecode(CPU, SIZE, False, NORMALISE, resize_bytes=1)(batch), decoded)
    std = torch.tensor(STD).view(3, 1, 1) * 255
    for number, data in enumerate(files):
        levels = ((decoded[number] - workers_image(data)).abs() * std).mean().item()  # in 0-255 grey levels
        assert levels < 2.0, (number, levels)


def test_a_png_and_a_cmyk_jpeg_among_jpegs_are_decoded_in_the_workers_and_keep_their_places(tmp_path: Path):
    write_image_folder(tmp_path / "images", {"ant": 4, "bee": 4}, size=(24, 30))
    (tmp_path / "images" / "ant" / "001.jpg").unlink()
    (tmp_path / "images" / "ant" / "001.png").write_bytes(jpeg_bytes(24, 30, format="PNG"))
    (tmp_path / "images" / "bee" / "002.jpg").write_bytes(jpeg_bytes(30, 24, "CMYK"))
    options = ClassificationOptions(dataset="imagefolder", data_dir=str(tmp_path / "images"), image_size=SIZE,
                                    eval_fraction=0.25, image_decode="device")
    data = ImageClassification(options).datasets(TaskContext(ONE_PROCESS, 3))
    split = data.train if any(name.endswith("001.png") for name in data.train.files) else data.test
    items = [split[index] for index in range(len(split))]
    odd = {index for index, name in enumerate(split.files) if name.endswith(("001.png", "bee/002.jpg"))}
    assert odd and {index for index, (image, _) in enumerate(items) if not isinstance(image, JpegBytes)} == odd
    batch, labels = data.collate_fn(items)
    assert sorted(batch.decoded_at) == sorted(odd) and labels.tolist() == split.labels.tolist()
    decoded = data.on_device(batch)
    for index in odd:  # the workers' own pixels, where they decoded
        assert torch.equal(decoded[index], workers_image(Path(split.files[index]).read_bytes()))


def test_a_batch_with_no_jpeg_for_the_device_is_the_workers_pixels():
    """A folder of PNGs (or a batch of CMYK JPEGs alone) under --image-decode device: nothing for the device."""
    files = [jpeg_bytes(24, 30, format="PNG", seed=1), jpeg_bytes(30, 24, "CMYK", seed=2)]
    batch, _ = collate_for_device_decode([worker_item(data, f"f{n}") for n, data in enumerate(files)])
    assert batch.jpegs() == [] and batch.decoded_at == [0, 1]
    decoded = DeviceDecode(CPU, SIZE, False, NORMALISE)(batch)
    for number, data in enumerate(files):
        assert torch.equal(decoded[number], workers_image(data, "RGB"))


def test_the_device_out_of_memory_is_raised_not_taken_for_a_refusal(monkeypatch, caplog):
    """Memory is not the bytes' fault: Pillow would hide it, and an item's pixels would depend on its batch."""
    batch, _ = collate_for_device_decode([worker_item(jpeg_bytes(30, 24), "a.jpg")])

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr("torchvision.io.decode_jpeg", out_of_memory)  # the decoder itself runs out
    with caplog.at_level(logging.WARNING), pytest.raises(torch.OutOfMemoryError):
        DeviceDecode(CPU, SIZE, False, NORMALISE)(batch)
    assert "Pillow decoded instead" not in caplog.text


def test_a_jpeg_the_device_refuses_is_decoded_by_pillow_with_a_warning_and_one_nothing_reads_is_one_line(caplog):
    good = jpeg_bytes(30, 24, seed=1)
    unended = jpeg_bytes(30, 24, seed=2)[:-2] + b"\0\0"  # no end marker: Pillow reads it
    batch, _ = collate_for_device_decode([worker_item(good, "a.jpg"), worker_item(unended, "b.jpg"),
                                          worker_item(jpeg_bytes(30, 24, format="PNG"), "c.png")])
    assert batch.encoded_at == [0, 1]
    decode = DeviceDecode(CPU, SIZE, False, NORMALISE)
    with caplog.at_level(logging.WARNING, logger="trainer.data.device_decode"):
        decoded = decode(batch)
    assert decoded.shape == (3, 3, SIZE, SIZE)
    assert torch.equal(decoded[1], workers_image(unended))
    assert [record.getMessage() for record in caplog.records] == \
        ["--image-decode device: the cpu decoder refused b.jpg, which Pillow decoded instead"]
    cut = jpeg_bytes(64, 48, seed=3)
    batch, _ = collate_for_device_decode([worker_item(good, "a.jpg"), worker_item(cut[:len(cut) // 2], "d.jpg")])
    with pytest.raises(DataError, match=r"^d.jpg: not a readable image \(.*\); replace or "
                                        r"remove the file$"):
        decode(batch)


def test_grey_shards_decode_on_the_device_and_name_a_broken_sample_by_its_shard(tmp_path: Path):
    files = [jpeg_bytes(30, 24, "L", seed=n) for n in range(5)] + [b"\xff\xd8\xff\xc0 broken"]
    write_dataset({"train": list(enumerate(files)), "eval": list(enumerate(files[:2]))}, str(tmp_path / "shards"),
                  encode=lambda item: {"jpg": item[1], "cls": str(item[0] % 2).encode()},
                  info={"num_classes": 2, "channels": 1})
    options = ClassificationOptions(dataset="shards", data_dir=str(tmp_path / "shards"), image_size=SIZE,
                                    image_decode="device")
    data = ImageClassification(options).datasets(TaskContext(ONE_PROCESS, 3))
    data.train.attach_cache(tmp_path / "cache", "train-rank0")
    items = [data.train[index] for index in range(5)]
    assert all(isinstance(image, JpegBytes) for image, _ in items)
    assert "train-000000.tar: sample 000000002: its .jpg member" in items[2][0].where
    decoded = data.on_device(data.collate_fn(items)[0])
    assert decoded.shape == (5, 1, SIZE, SIZE)
    grey = torch.stack([workers_image(file, "L", data.on_device.normalise) for file in files[:5]])
    assert (grey - decoded).abs().mean() < 0.02  # normalised units: under a grey level
    with pytest.raises(DataError, match=r"train-000000.tar: sample 000000005: its .jpg member: not a readable "
                                        r"image"):
        data.train[5]  # a start of frame cut short: not for the device, and Pillow cannot read it


def test_the_flag_is_refused_where_the_dataset_is_read_decoded_already():
    with pytest.raises(ConfigError, match=r"--image-decode device decodes image files: it applies to --dataset "
                                          r"imagefolder or shards, and --dataset synthetic is read decoded already"):
        ClassificationOptions(dataset="synthetic", image_decode="device")
    with pytest.raises(ConfigError, match=r"^--image-decode .gpu.: choose one of workers, device$"):
        ClassificationOptions(dataset="imagefolder", image_decode="gpu")  # one line with the choices
