"""CIFAR-10's "python version" batches, unpickled with only the types those files contain.

Each batch is a pickled dict: b"data" a uint8 numpy array [N, 3072] (1024 red, then green, then
blue values of a 32x32 image, row by row), b"labels" a list of N ints, plus a batch label and file
names. A plain ``pickle.load`` would run any callable a tampered file names, and datasets come from
object stores and shared folders, so the unpickler below refuses every global except the handful
that rebuild a numpy array.
"""

from __future__ import annotations

import codecs
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.errors import DataError

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]

TRAIN_BATCHES = tuple(f"data_batch_{n}" for n in range(1, 6))
TEST_BATCH = "test_batch"
CHANNELS, SIZE, NUM_CLASSES = 3, 32, 10


def _empty_array(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    """numpy pickles an array as ``_reconstruct(ndarray, (0,), b'b')``, an empty array, then its state, which
    carries the bytes (and numpy checks that they fill the shape). Any other shape here would allocate
    memory that no byte of the file backs: a file of 120 bytes could ask for 3 GB."""
    if subtype is not np.ndarray or not isinstance(shape, tuple) or shape != (0,):
        raise pickle.UnpicklingError(f"an array of shape {list(shape) if isinstance(shape, tuple) else shape!r} "
                                     "with no data behind it (numpy writes empty arrays here)")
    return _reconstruct(subtype, shape, dtype)


# The files were written by Python 2 and numpy 1 ("numpy.core"); numpy 2 writes "numpy._core";
# Python 3 pickles bytes at protocol 2 through _codecs.encode.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _empty_array,
    ("numpy._core.multiarray", "_reconstruct"): _empty_array,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of a CIFAR-10 batch") from None


def read_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch file: images uint8 [N,3,32,32] and labels int64 [N]."""
    try:
        with path.open("rb") as file:
            # encoding="bytes" keeps Python 2 strings as bytes, as the dataset's own page reads them.
            batch = _ArrayOnlyUnpickler(file, encoding="bytes").load()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error.strerror or error})") from None
    except Exception as error:  # a damaged pickle raises almost anything: EOFError, ValueError, KeyError...
        raise DataError(f"{path}: not a readable CIFAR-10 python batch ({type(error).__name__}: {error})") from None
    return _validate(path, batch)


def read_batches(paths: Sequence[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [read_batch(path) for path in paths]
    return torch.cat([images for images, _ in parts]), torch.cat([labels for _, labels in parts])


def _validate(path: Path, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataError(f"{path}: expected a dict with b'data' and b'labels' (a CIFAR-10 python batch)")
    data, labels = batch[b"data"], batch[b"labels"]
    pixels = CHANNELS * SIZE * SIZE
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != pixels:
        found = f"{data.dtype} {list(data.shape)}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: b'data' must be a uint8 array [N, {pixels}], found {found}")
    if not isinstance(labels, list) or not all(isinstance(label, int) for label in labels):
        raise DataError(f"{path}: b'labels' must be a list of ints")
    if len(labels) != data.shape[0]:
        raise DataError(f"{path}: {data.shape[0]} images but {len(labels)} labels")
    label_tensor = torch.tensor(labels, dtype=torch.int64)
    if labels and not 0 <= min(labels) <= max(labels) < NUM_CLASSES:
        raise DataError(f"{path}: labels must lie in 0..{NUM_CLASSES - 1}, found {min(labels)}..{max(labels)}")
    return torch.from_numpy(data.reshape(-1, CHANNELS, SIZE, SIZE).copy()), label_tensor
