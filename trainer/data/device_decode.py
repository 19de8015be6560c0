"""``--image-decode device``: JPEG images decoded on the training device, a batch at a time, instead of in the
DataLoader workers.

A worker's share of the work is then reading a file's bytes (trainer.data.jpeg_bytes): no decode, no resize. The
batch's JPEG bytes stay in host memory (torchvision.io.decode_jpeg reads them from there, for nvJPEG too) and
the task's ``on_device`` step, ``DeviceDecode``, decodes them together on the device (nvJPEG on a GPU; on the
CPU, libjpeg-turbo, which is how this path is tested without one), resizes each so that its shorter side is the
image size and crops the centred square, as the workers' path does, then normalises. The decoders give the same
pixels for the same bytes each time, so an item is still a function of its index alone: a resumed run sees the
batches an uninterrupted one sees (the built-in task draws no random transform).

What the device cannot decode is decoded in the worker, as before, and joins the batch as pixels (a PNG among
the JPEGs, a CMYK JPEG: the header says which). A JPEG the device refuses anyway (a corrupt one) makes the batch
decode again one image at a time; each one the device refuses on its own is decoded by Pillow, with a warning,
and one that Pillow cannot read either is the usual one line naming the file.

The two paths do not give identical pixels (Pillow decodes JPEGs at a reduced size and resizes bilinearly; here
the full image is decoded and resized with antialiasing), so a resume that changes --image-decode is refused
unless named in --allow-resume-change.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.data.dataset import Normalise
from trainer.data.imagefolder import decode_image
from trainer.data.jpeg_bytes import DecodeBatch
from trainer.errors import DataError

log = logging.getLogger(__name__)

__all__ = ["IMAGE_DECODE_PLACES", "DeviceDecode"]

IMAGE_DECODE_PLACES = ("workers", "device")


@dataclass(frozen=True)
class DeviceDecode:
    """The task's ``on_device`` step for a DecodeBatch: its JPEGs decoded on ``device``, resized and cropped to
    ``size``; what the workers decoded (cropped already) only moved; the batch stacked and normalised."""

    device: torch.device
    size: int
    grey: bool  # one channel (Pillow's "L"), else RGB
    normalise: Normalise
    # At most this many bytes of images in float at once while resizing: a batch of 256 six-megapixel photos would
    # want 18 GB in one go (the decoders take the full image; Pillow's draft mode, which the workers use, does not
    # exist for them). A batch of small images of one shape is still one resize.
    resize_bytes: int = 1 << 28

    def __call__(self, batch: DecodeBatch | Tensor) -> Tensor:
        if isinstance(batch, Tensor):  # pixels already (a batch that did not come through the workers' half)
            return self.normalise(batch.to(self.device, non_blocking=True))
        if not len(batch):
            raise DataError("--image-decode device: a batch with no images")
        images: dict[int, Tensor] = {}
        if batch.decoded is not None:
            images.update(zip(batch.decoded_at, batch.decoded.to(self.device, non_blocking=True), strict=True))
        images.update(zip(batch.encoded_at, self._decoded(batch.jpegs(), batch.wheres), strict=True))
        return self.normalise(torch.stack([images[place] for place in range(len(batch))]))

    def _decoded(self, jpegs: list[Tensor], wheres: list[str]) -> list[Tensor]:
        """The JPEGs decoded, resized and cropped on the device: together where it takes the batch, else one at a
        time, with Pillow for each it refuses."""
        if not jpegs:
            return []
        decoded = self._decode(jpegs)
        return self._one_at_a_time(jpegs, wheres) if decoded is None else self._cropped(decoded)

    def _decode(self, jpegs: list[Tensor]) -> list[Tensor] | None:
        """The JPEGs decoded at full size, or None where the decoder refuses them. Only the decoder's call is
        guarded: memory is not the bytes' fault, so running out is raised, never sent to Pillow."""
        from torchvision.io import ImageReadMode, decode_jpeg

        mode = ImageReadMode.GRAY if self.grey else ImageReadMode.RGB
        try:
            return decode_jpeg(jpegs, mode=mode, device=self.device)
        except torch.OutOfMemoryError:
            raise  # a smaller --batch-size is the fix, not Pillow
        except RuntimeError:  # torchvision's decoders raise RuntimeError for bytes they cannot decode
            return None

    def _one_at_a_time(self, jpegs: list[Tensor], wheres: list[str]) -> list[Tensor]:
        done, refused = [], []
        for jpeg, where in zip(jpegs, wheres, strict=True):
            decoded = self._decode([jpeg])
            if decoded is not None:
                done.extend(self._cropped(decoded))
                continue
            refused.append(where)
            pixels = decode_image(io.BytesIO(jpeg.numpy().tobytes()), self.size, where, "L" if self.grey else "RGB")
            done.append(pixels.to(self.device, non_blocking=True))
        if refused:
            more = f" and {len(refused) - 1} more" if len(refused) > 1 else ""
            log.warning("--image-decode device: the %s decoder refused %s%s, which Pillow decoded instead",
                        self.device.type, refused[0], more)
        return done

    def _cropped(self, images: list[Tensor]) -> list[Tensor]:
        """Each image's shorter side resized to ``size`` (bilinear, antialiased), then the centred square: the
        geometry of trainer.data.imagefolder.decode_image. Images of one shape are resized together (one kernel
        launch for all of them, where a photo collection has a few common shapes), ``resize_bytes`` of them in
        float at a time."""
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for position, image in enumerate(images):
            by_shape.setdefault(tuple(image.shape), []).append(position)
        done: dict[int, Tensor] = {}
        for (channels, height, width), positions in by_shape.items():
            tall, wide = self._resized(height, width)
            at_once = max(1, self.resize_bytes // (4 * channels * max(height * width, tall * wide)))
            for first in range(0, len(positions), at_once):
                group = positions[first:first + at_once]
                done.update(zip(group, self._square(torch.stack([images[p] for p in group]), height, width),
                                strict=True))
        return [done[position] for position in range(len(images))]

    def _square(self, images: Tensor, height: int, width: int) -> Tensor:
        size = self.size
        if (width, height) == (size, size):
            return images
        resized = self._resized(height, width)
        images = torch.nn.functional.interpolate(images.float(), size=resized, mode="bilinear", align_corners=False,
                                                 antialias=True)
        images = images.round_().clamp_(0, 255).to(torch.uint8)
        top, left = (resized[0] - size) // 2, (resized[1] - size) // 2
        return images[:, :, top:top + size, left:left + size].contiguous()  # not a view holding the whole resize

    def _resized(self, height: int, width: int) -> tuple[int, int]:
        """The shape an image of ``height`` x ``width`` is resized to: its shorter side ``size``."""
        scale = self.size / min(width, height)
        return max(self.size, round(height * scale)), max(self.size, round(width * scale))
