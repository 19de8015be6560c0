"""Small datasets written in the real on-disk formats (IDX, CIFAR-10 python batches, JPEG/PNG folders)."""

from __future__ import annotations

import io
import pickle
import struct
from pathlib import Path

import numpy as np
import torch

from trainer.data.catalog import IDX_FILES
from trainer.data.cifar import TEST_BATCH, TRAIN_BATCHES
from trainer.data.idx import write_idx


def write_idx_dataset(folder: Path, train_size: int = 40, test_size: int = 20, suffix: str = ".gz",
                      seed: int = 0) -> dict[str, np.ndarray]:
    """The four MNIST-style files with random 28x28 images and labels cycling through 0..9; returns the arrays."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, size in zip(IDX_FILES, (train_size, train_size, test_size, test_size), strict=True):
        arrays[name] = (rng.integers(0, 256, (size, 28, 28), dtype=np.uint8) if "images" in name
                        else (np.arange(size) % 10).astype(np.uint8))
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        write_idx(folder / (name + suffix), array)
    return arrays


class _Python2Pickler(pickle._Pickler):
    """Writes every string as a Python 2 str (BINSTRING opcodes), as cPickle did for the published batches."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_python2_str(self, obj: bytes | str) -> None:
        data = obj if isinstance(obj, bytes) else obj.encode("latin-1")
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[bytes] = save_python2_str
    dispatch[str] = save_python2_str


def python2_pickle(value: object) -> bytes:
    """The bytes Python 2 and numpy 1 would have written (numpy 2 names its module numpy._core)."""
    buffer = io.BytesIO()
    _Python2Pickler(buffer, protocol=2).dump(value)
    # Protocol 2 names a global as text ("c" module newline name newline): swapped in place.
    numpy2, numpy1 = b"cnumpy._core.multiarray\n_reconstruct\n", b"cnumpy.core.multiarray\n_reconstruct\n"
    return buffer.getvalue().replace(numpy2, numpy1)


def write_cifar_dataset(folder: Path, per_batch: int = 6, seed: int = 0) -> dict[str, dict[bytes, object]]:
    """data_batch_1..5 and test_batch in the published format: Python 2 pickles of dicts."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    batches = {}
    for number, name in enumerate((*TRAIN_BATCHES, TEST_BATCH)):
        batch = {
            b"batch_label": f"batch {number}".encode(),
            b"labels": [int(label) for label in rng.integers(0, 10, per_batch)],
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"filenames": [f"image_{number}_{i}.png".encode() for i in range(per_batch)],
        }
        (folder / name).write_bytes(python2_pickle(batch))
        batches[name] = batch
    return batches


def write_image_folder(root: Path, classes: dict[str, int], size: tuple[int, int] = (20, 28), seed: int = 0,
                       fmt: str = "jpg") -> None:
    """root/<class>/<n>.<fmt>: small RGB images; class k is bright in channel k % 3. Real JPEG or PNG files."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    for number, (name, count) in enumerate(sorted(classes.items())):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(count):
            base = torch.zeros(3, *size)
            base[number % 3] = 160 + 40 * (number // 3)
            pixels = (base + 30 * torch.rand(3, *size, generator=generator)).clamp(0, 255).to(torch.uint8)
            Image.fromarray(pixels.permute(1, 2, 0).numpy()).save(folder / f"{index:03d}.{fmt}")


def jpeg_bytes(height: int, width: int, mode: str = "RGB", seed: int = 0, **save: object) -> bytes:
    """One picture encoded by Pillow (JPEG unless ``format=`` says otherwise; ``mode`` L, RGB or CMYK): a smooth
    gradient with some noise, a photo's statistics more than pure noise."""
    from PIL import Image

    channels = {"L": 1, "RGB": 3, "CMYK": 4}[mode]
    generator = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(20, 220, width).repeat(height, 1)[None].repeat(channels, 1, 1)
    pixels = (ramp + 25 * torch.rand(channels, height, width, generator=generator)).clamp(0, 255).to(torch.uint8)
    array = pixels.permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(array[:, :, 0] if channels == 1 else array, mode).save(buffer, format=save.pop("format", "JPEG"),
                                                                             **save)
    return buffer.getvalue()
