"""--image-decode device with nvJPEG, and a compiled run's exact resume, on a CUDA GPU (``make gpu-check``)."""

from __future__ import annotations

import io
import logging
import subprocess
from pathlib import Path

import pytest
import torch

from devtools.processes import torchrun
from tests.support.checkpoint_reading import assert_same_tensors, newest_checkpoint, summary
from tests.support.data_files import jpeg_bytes, write_image_folder
from trainer.data.dataset import Normalise
from trainer.data.device_decode import DeviceDecode
from trainer.data.imagefolder import MEAN, STD, decode_image
from trainer.data.jpeg_bytes import collate_for_device_decode, for_device

SIZE = 32
NORMALISE = Normalise(MEAN, STD)


def test_a_batch_decodes_on_the_gpu_as_on_the_cpu_within_a_grey_level_and_alike_each_time(caplog):
    files = [jpeg_bytes(60, 48, seed=1), jpeg_bytes(48, 60, seed=2), jpeg_bytes(128, 96, progressive=True, seed=3),
             jpeg_bytes(60, 48, "L", seed=4), jpeg_bytes(60, 48, format="PNG", seed=5), jpeg_bytes(60, 48, "CMYK"),
             jpeg_bytes(60, 48, seed=6)[:-2] + b"\0\0"]  # the last with no end marker: Pillow reads it
    items = [(for_device(data, f"f{n}") or decode_image(io.BytesIO(data), SIZE, f"f{n}"), torch.tensor(n))
             for n, data in enumerate(files)]
    batch, _ = collate_for_device_decode(items)
    assert batch.decoded_at == [4, 5]  # the PNG and the CMYK JPEG, decoded in the worker
    on_gpu = DeviceDecode(torch.device("cuda"), SIZE, False, NORMALISE)
    with caplog.at_level(logging.WARNING, logger="trainer.data.device_decode"):
        decoded = on_gpu(batch)
    assert decoded.device.type == "cuda" and decoded.shape == (7, 3, SIZE, SIZE)
    assert torch.equal(decoded, on_gpu(batch))  # nvJPEG: the same bytes, the same pixels
    on_cpu = DeviceDecode(torch.device("cpu"), SIZE, False, NORMALISE)(batch)
    levels = ((decoded.cpu() - on_cpu).abs() * torch.tensor(STD).view(1, 3, 1, 1) * 255).mean((1, 2, 3))
    assert (levels < 2.0).all(), levels.tolist()
    print(f"nvJPEG against the CPU decoder, mean grey levels per image: {[round(x, 3) for x in levels.tolist()]}; "
          f"warnings: {[record.getMessage() for record in caplog.records]}")


def test_the_trainer_decodes_an_image_folder_with_nvjpeg(tmp_path):
    write_image_folder(tmp_path / "images", {"ant": 16, "bee": 16}, size=(40, 48))
    result = torchrun(["--dataset", "imagefolder", "--data-dir", str(tmp_path / "images"), "--image-size", str(SIZE),
                       "--image-decode", "device", "--num-workers", "2", "--epochs", "1", "--batch-size", "8",
                       "--progress", "off", "--no-tensorboard", "--output-dir", str(tmp_path / "run")], nproc=1,
                      timeout_s=400)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "each batch is decoded on cuda:0 (nvJPEG)" in result.stderr
    assert summary(tmp_path / "run")["epochs_completed"] == 1


def _wide(output: Path, sync: str, *extra: str) -> subprocess.CompletedProcess[str]:
    # 32 samples, batch 4: 8 steps an epoch. Linear layers only: cuBLAS's GEMMs and inductor's kernels give the
    # same bits run after run (cuDNN's convolution backward may not).
    result = torchrun(["--task", "tests.support.tasks:WideTask", "--blocks", "4", "--width", "256", "--batch-size",
                       "4", "--epochs", "2", "--checkpoint-every", "2", "--precision", "bf16", "--sync", sync,
                       "--compile", "--progress", "off", "--no-tensorboard", "--output-dir", str(output), *extra],
                      nproc=1, timeout_s=400)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.parametrize("sync", ["ddp", "fsdp"])
def test_a_compiled_run_stopped_mid_epoch_resumes_bitwise_on_the_gpu(tmp_path, sync):
    _wide(tmp_path / "straight", sync)
    _wide(tmp_path / "run", sync, "--max-steps", "5")
    _wide(tmp_path / "run", sync)
    assert summary(tmp_path / "run")["resumed_from"].endswith("step-00000005")
    ends = [newest_checkpoint(tmp_path / name / "checkpoints")[2] for name in ("straight", "run")]
    assert ends[0]["position"]["step"] == 16
    assert_same_tensors({part: ends[1][part] for part in ("model", "optimizer", "position")},
                        {part: ends[0][part] for part in ("model", "optimizer", "position")})
