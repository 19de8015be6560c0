"""The built-in task on a folder of JPEG files with a torchvision model: decoded in DataLoader workers."""

from __future__ import annotations

from devtools.processes import torchrun
from tests.support.checkpoint_reading import summary
from tests.support.data_files import write_image_folder


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
