"""The workers' half of ``--image-decode device`` (trainer.data.device_decode): an image file's bytes handed over
undecoded where the device can decode them, and a batch of such images collated without being decoded.

Which JPEGs the device decodes is read from the file's own header (``device_decodable``): 8-bit, 1 or 3
components (grey, YCbCr), Huffman coded (baseline, extended or progressive), what nvJPEG decodes. Everything
else (PNG, BMP, CMYK and YCCK JPEGs, arithmetic or lossless coding, a header cut short) the worker decodes with
Pillow as it always has, and it joins the batch as pixels.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DecodeBatch", "JpegBytes", "collate_for_device_decode", "device_decodable", "for_device", "with_origin"]

_JPEG_START = b"\xff\xd8"
# Start-of-frame markers of the codings nvJPEG decodes: baseline, extended sequential, progressive (Huffman).
_DEVICE_FRAMES = {0xC0, 0xC1, 0xC2}
# The other start-of-frame markers: lossless, hierarchical and arithmetic codings.
_OTHER_FRAMES = {0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
# Markers with no length after them (restart markers, TEM).
_STANDALONE = {0x01, *range(0xD0, 0xD8)}
_START_OF_SCAN = 0xDA


@dataclass(frozen=True)
class JpegBytes:
    """An item's image as a worker hands it over: a JPEG file's bytes, for the device to decode."""

    data: bytes
    where: str  # the file or shard member it came from, named by the one line an unreadable image gets


@dataclass
class DecodeBatch:
    """A batch's images as the workers left them, in two tensors whatever the batch size: a worker sends each
    tensor of a batch through a shared-memory segment of its own, and a batch of 256 files in 256 tensors would
    cost 256 of them. Not a tensor itself, so moving the batch to the device leaves it in host memory
    (trainer.task.to_device), where torchvision's decoders read it (nvJPEG included)."""

    encoded: Tensor  # uint8, 1-D: the batch's JPEG files end to end
    ends: list[int]  # where each of them ends in ``encoded``
    encoded_at: list[int]  # and its place in the batch
    wheres: list[str]  # and where it came from
    decoded: Tensor | None  # uint8 N,C,H,W: the images the workers decoded (not JPEGs the device decodes)
    decoded_at: list[int]  # their places in the batch

    def __len__(self) -> int:
        return len(self.encoded_at) + len(self.decoded_at)

    def jpegs(self) -> list[Tensor]:
        """Each JPEG's bytes, a view into ``encoded``, as torchvision's decoders take them."""
        return [self.encoded[start:end] for start, end in itertools.pairwise([0, *self.ends])]


def device_decodable(data: bytes | bytearray | memoryview) -> bool:
    """Whether a file's bytes are a JPEG the device decodes, from its markers up to the first frame header."""
    view = memoryview(data)
    if len(view) < 4 or bytes(view[:2]) != _JPEG_START:
        return False
    offset = 2
    while offset + 4 <= len(view):
        if view[offset] != 0xFF:
            return False
        marker = view[offset + 1]
        if marker == 0xFF:  # a fill byte before the marker
            offset += 1
            continue
        if marker in _STANDALONE:
            offset += 2
            continue
        if marker in _OTHER_FRAMES or marker == _START_OF_SCAN:
            return False
        if marker in _DEVICE_FRAMES:
            if offset + 10 > len(view):
                return False
            precision, components = view[offset + 4], view[offset + 9]
            return precision == 8 and components in (1, 3)
        length = (view[offset + 2] << 8) | view[offset + 3]
        if length < 2:
            return False
        offset += 2 + length
    return False


def for_device(data: bytes, where: str) -> JpegBytes | None:
    """The bytes as the worker sends them for the device to decode, or None: the worker decodes this one."""
    return JpegBytes(bytes(data), where) if device_decodable(data) else None


def collate_for_device_decode(items: Sequence[tuple[JpegBytes | Tensor, Tensor]]) -> tuple[DecodeBatch, Tensor]:
    """(image, label) items, each image JpegBytes or uint8 C,H,W pixels -> (one DecodeBatch, the labels)."""
    jpegs = [(place, image) for place, (image, _) in enumerate(items) if isinstance(image, JpegBytes)]
    pixels = [(place, image) for place, (image, _) in enumerate(items) if not isinstance(image, JpegBytes)]
    joined = b"".join(image.data for _, image in jpegs)
    ends = list(itertools.accumulate(len(image.data) for _, image in jpegs))
    encoded = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    batch = DecodeBatch(encoded, ends, [place for place, _ in jpegs], [image.where for _, image in jpegs],
                        torch.stack([image for _, image in pixels]) if pixels else None,
                        [place for place, _ in pixels])
    return batch, torch.stack([torch.as_tensor(label) for _, label in items])


def with_origin(item: object, origin: str) -> object:
    """An (image, label) item whose JpegBytes names where it is within ``origin`` (a shard's sample), for the line
    a JPEG that no decoder reads gets when the device finds it; any other item as it is."""
    if isinstance(item, tuple) and item and isinstance(item[0], JpegBytes):
        image = item[0]
        return (JpegBytes(image.data, f"{origin}: {image.where}"), *item[1:])
    return item
