"""The built-in task on a folder of JPEG files: decoded in DataLoader workers (with a torchvision model), or on
the device."""

from __future__ import annotations

import sys
from pathlib import Path

from devtools.processes import run, torchrun
from tests.support.checkpoint_reading import assert_same_tensors, newest_checkpoint, summary
from tests.support.data_files import write_image_folder
from trainer.errors import EXIT_USAGE


def test_an_image_folder_trains_a_torchvision_model_on_two_ranks_with_workers_by_default(tmp_path):
    write_image_folder(tmp_path / "images", {"ant": 12, "bee": 12, "cat": 12}, size=(24, 30))
    args = ["--dataset", "imagefolder", "--data-dir", str(tmp_path / "images"), "--image-size", "32",
            "--eval-fraction", "0.25", "--model", "torchvision/squeezenet1_1", "--epochs", "2", "--batch-size", "8",
            "--progress", "off", "--no-tensorboard", "--output-dir", str(tmp_path / "run")]
    result = torchrun(args, nproc=2, timeout_s=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: 27 training and 9 evaluation samples; 1 DataLoader worker(s) per rank (--num-workers auto)" \
        in result.stderr
    final = summary(tmp_path / "run")
    assert final["test_samples"] == 9 and final["epochs_completed"] == 2 and final["world_size"] == 2


def test_jpegs_decoded_on_the_device_train_with_a_png_and_a_cmyk_jpeg_among_them_and_resume_bitwise(tmp_path):
    """--image-decode device on the CPU (torchvision's decoder in nvJPEG's place), through DataLoader workers: a
    run stopped mid-epoch and resumed ends bitwise where one uninterrupted run does, and a resume that would
    decode elsewhere is refused."""
    from PIL import Image

    images = tmp_path / "images"
    write_image_folder(images, {"ant": 8, "bee": 8, "cat": 8}, size=(24, 30))
    Image.open(images / "ant" / "001.jpg").save(images / "ant" / "001.png")
    (images / "ant" / "001.jpg").unlink()
    Image.open(images / "bee" / "002.jpg").convert("CMYK").save(images / "bee" / "002.jpg")
    args = ["--dataset", "imagefolder", "--data-dir", str(images), "--image-size", "16", "--eval-fraction", "0.25",
            "--image-decode", "device", "--epochs", "2", "--batch-size", "4", "--num-workers", "1",
            "--checkpoint-every", "2", "--progress", "off", "--no-tensorboard"]

    def train(output: Path, *extra: str) -> str:
        result = run([sys.executable, "-m", "trainer", *args, "--output-dir", str(output), *extra])
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stderr

    said = train(tmp_path / "reference")
    assert "--image-decode device: the workers read JPEG files' bytes; each batch is decoded on cpu" in said
    train(tmp_path / "run", "--max-steps", "3")
    _, stopped, _ = newest_checkpoint(tmp_path / "run" / "checkpoints")
    assert stopped["step"] == 3 and stopped["samples_in_epoch"] > 0
    elsewhere = run([sys.executable, "-m", "trainer", *args, "--output-dir", str(tmp_path / "run"), "--image-decode",
                     "workers"])
    assert elsewhere.returncode == EXIT_USAGE, elsewhere.stderr[-3000:]
    [line] = [line for line in elsewhere.stderr.splitlines() if "error:" in line]
    assert "image_decode" in line and "--allow-resume-change" in line and "Traceback" not in elsewhere.stderr
    train(tmp_path / "run")
    assert summary(tmp_path / "run")["resumed_from"].endswith("step-00000003")
    ends = [newest_checkpoint(tmp_path / name / "checkpoints") for name in ("reference", "run")]
    assert ends[0][1]["step"] == ends[1][1]["step"] == 10
    assert_same_tensors({key: ends[1][2][key] for key in ("model", "optimizer", "position")},
                        {key: ends[0][2][key] for key in ("model", "optimizer", "position")})
