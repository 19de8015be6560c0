"""The IDX format of MNIST and Fashion-MNIST, plain or gzipped, read with every header field checked.

Layout (big-endian): two zero bytes, an element-type byte (0x08: unsigned byte, the only one
these datasets use), the number of dimensions, one uint32 per dimension, then the elements.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from trainer.errors import DataError

UBYTE = 0x08
IMAGES_NDIM = 3  # count, rows, columns
LABELS_NDIM = 1  # count


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """An IDX file's uint8 array, after checking magic number, dimensions and length against the header."""
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise DataError(f"{path}: {len(raw)} bytes is too short for an IDX header; the file is truncated")
    zero, dtype, found_ndim = raw[0:2], raw[2], raw[3]
    if zero != b"\x00\x00" or found_ndim != ndim:
        raise DataError(
            f"{path}: not an IDX file with {ndim} dimension(s) (magic number 0x{raw[:4].hex()}, expected "
            f"0x0000{UBYTE:02x}{ndim:02x}); is it the right file, or an HTML error page saved by a failed download?"
        )
    if dtype != UBYTE:
        raise DataError(f"{path}: IDX element type 0x{dtype:02x} is not supported; expected unsigned bytes (0x08)")
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise DataError(f"{path}: the IDX header is cut short ({len(raw)} bytes); the file is truncated")
    dims = struct.unpack(f">{ndim}I", raw[4:header_size])
    expected = header_size + int(np.prod(dims, dtype=np.int64))
    if len(raw) != expected:
        state = "truncated" if len(raw) < expected else "longer than its header says"
        raise DataError(
            f"{path}: {state}: the header declares shape {list(dims)} ({expected} bytes) but the file has "
            f"{len(raw)} bytes; fetch the file again"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header_size).reshape(dims)


def read_images_and_labels(images_path: Path, labels_path: Path, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One split: images uint8 [N,1,H,W] and labels int64 [N], counts and label values checked."""
    images = read_idx(images_path, IMAGES_NDIM)
    labels = read_idx(labels_path, LABELS_NDIM)
    if images.shape[0] != labels.shape[0]:
        raise DataError(
            f"{images_path} holds {images.shape[0]} images but {labels_path} holds {labels.shape[0]} labels; "
            f"the two files belong to different splits or datasets"
        )
    if labels.size and int(labels.max()) >= num_classes:
        raise DataError(f"{labels_path}: label {int(labels.max())} is outside 0..{num_classes - 1}; wrong dataset?")
    # np.frombuffer views are read-only; torch wants writable memory, and int64 labels are a copy anyway.
    return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array as IDX, gzipped when the name ends in .gz (bit-for-bit reproducible: no timestamp)."""
    if array.dtype != np.uint8:
        raise ValueError(f"IDX writing supports uint8 arrays only, got {array.dtype}")
    header = bytes([0, 0, UBYTE, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + np.ascontiguousarray(array).tobytes()
    if path.suffix == ".gz":
        payload = gzip.compress(payload, compresslevel=9, mtime=0)
    path.write_bytes(payload)


def _read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as file:
                return file.read()
        return path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise DataError(f"{path}: not a valid gzip file ({error}); fetch the file again") from None
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error.strerror or error})") from None
