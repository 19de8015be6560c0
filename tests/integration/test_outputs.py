"""The run's own outputs (metrics.jsonl, TensorBoard, config.yaml, summary.json) on a read-only or full disk,
with two real ranks: one line that says what to do, exit 2 on every rank, the checkpoints untouched."""

from __future__ import annotations

from devtools.processes import env_ranks
from tests.support.mounts import mount_tmpfs
from trainer.checkpoint import open_storage, verify
from trainer.errors import EXIT_USAGE

# 2 ranks x 16 samples: 8 steps an epoch; a metrics line every step.
RUN = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--synthetic-test-size", "64", "--batch-size",
       "16", "--progress", "off", "--no-tensorboard", "--checkpoint-every", "4", "--log-every", "1"]


def failed_alike(ranks: list, message: str) -> list[str]:
    """Every rank exited 2 with one error line holding ``message``, and no traceback; returns the lines."""
    lines = []
    for rank, result in enumerate(ranks):
        assert result.returncode == EXIT_USAGE, result.stderr[-3000:]
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
        assert line.startswith(f"[rank {rank}] error: ") and message in line, line
        lines.append(line)
    return lines


def test_a_read_only_output_folder_is_one_line_on_every_rank_before_training(mount_point, tmp_path):
    mount_tmpfs("ro,size=64k", mount_point)
    ranks = env_ranks([*RUN, "--epochs", "1", "--output-dir", str(mount_point), "--checkpoint-dir",
                       str(tmp_path / "checkpoints")], world_size=2, timeout_s=120)
    failed_alike(ranks, f"cannot write {mount_point}/metrics.jsonl (Read-only file system); fix the permissions of "
                        f"{mount_point} or choose another --output-dir")
    assert not list((tmp_path / "checkpoints").glob("step-*")), "no checkpoint written"


def test_a_disk_that_fills_up_mid_run_is_one_line_on_every_rank_and_the_checkpoints_stay(mount_point, tmp_path):
    mount_tmpfs("size=8k", mount_point)  # two pages: config.yaml, then about 16 lines of metrics.jsonl
    checkpoints = tmp_path / "checkpoints"
    ranks = env_ranks([*RUN, "--epochs", "4", "--output-dir", str(mount_point), "--checkpoint-dir", str(checkpoints)],
                      world_size=2, timeout_s=120)
    failed_alike(ranks, f"cannot write {mount_point}/metrics.jsonl (No space left on device); free space on "
                        f"{mount_point} or choose another --output-dir")
    assert (mount_point / "config.yaml").is_file()
    storage = open_storage(str(checkpoints))
    assert storage.list_checkpoints(), "the run trained for a while before the disk was full"
    for name in storage.list_checkpoints():
        verify(storage, name)


def test_a_tensorboard_folder_that_fills_up_is_one_line_on_every_rank_and_the_checkpoints_stay(mount_point, tmp_path):
    output = tmp_path / "run"
    output.mkdir()
    (output / "tensorboard").symlink_to(mount_point)  # the event files on a disk of their own, 8 KB
    mount_tmpfs("size=8k", mount_point)
    checkpoints = tmp_path / "checkpoints"
    ranks = env_ranks([*RUN, "--tensorboard", "--epochs", "20", "--output-dir", str(output), "--checkpoint-dir",
                       str(checkpoints)], world_size=2, timeout_s=120)
    failed_alike(ranks, f"cannot write {output}/tensorboard (No space left on device); free space on "
                        f"{output} or choose another --output-dir")
    storage = open_storage(str(checkpoints))
    assert storage.list_checkpoints(), "the run trained for a while before the disk was full"
    for name in storage.list_checkpoints():
        verify(storage, name)
