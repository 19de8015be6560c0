"""The trainer's checkpoints, seen from the command line: what a checkpoint holds, how broken ones are
skipped, and the one-line errors for bad inputs (another model, unwritable folder, full disk), none of
which touches a good checkpoint."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from devtools.processes import run
from tests.support.checkpoint_damage import break_checkpoint, checkpoint_bytes
from tests.support.checkpoint_reading import assert_same_tensors, every_file_under, newest_checkpoint, summary
from tests.support.mounts import mount_tmpfs
from trainer.checkpoint import TrainingState, open_storage, verify
from trainer.checkpoint.storage import step_of
from trainer.checkpoint.writer import save_state
from trainer.errors import EXIT_USAGE
from trainer.main import main
from trainer.models import build_model
from trainer.tasks import ClassificationOptions

# 1 process x 16 samples: 16 steps, a checkpoint every 2.
COMMON = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--synthetic-test-size", "64", "--epochs", "1",
          "--batch-size", "16", "--progress", "off", "--no-tensorboard", "--checkpoint-every", "2"]


def trainer(output_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "trainer", *COMMON, "--output-dir", str(output_dir), *extra])


def final_params(checkpoint_dir: Path) -> dict:
    name, _, state = newest_checkpoint(checkpoint_dir)
    assert name == "step-00000016"
    return {"model": state["model"], "optimizer": state["optimizer"], "position": state["position"]}


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines a user reads as the failure: one, with no traceback."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if "error:" in line]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run keeping all 8 checkpoints (steps 2, 4, ..., 16)."""
    output = tmp_path_factory.mktemp("reference")
    result = trainer(output, "--keep-last", "10")
    assert result.returncode == 0, result.stderr[-3000:]
    return output / "checkpoints"


@pytest.fixture
def checkpoints(reference: Path, tmp_path: Path) -> Path:
    """A private copy of the reference checkpoints, to break or to resume from."""
    copy = tmp_path / "checkpoints"
    shutil.copytree(reference, copy)
    return copy


def test_a_checkpoint_holds_the_full_state_and_its_model_loads_into_a_plain_model(reference):
    _, manifest, state = newest_checkpoint(reference)
    assert set(state) == {"model", "optimizer", "grad_scaler", "position", "task", "rng", "config", "trackers",
                          "world_size", "versions", "part_versions"}
    assert state["part_versions"] == {**dict.fromkeys(("model", "grad_scaler", "rng", "position", "task", "config"), 1),
                                      "trackers": 2, "optimizer": 2}
    assert state["trackers"]["runs"] == {}, "no --tracker: no tracker run to continue"
    assert state["trackers"]["output_dir"] == str(reference.parent.resolve())  # the run whose trackers they are
    assert state["world_size"] == 1 and len(state["rng"]) == 1 and set(state["rng"][0]) >= {"python", "numpy", "torch"}
    assert state["position"]["step"] == manifest["step"] == 16 and state["optimizer"]["state"]
    assert {"torch", "torchvision", "trainer", "python"} <= set(state["versions"])
    assert (state["task"]["name"], manifest["task"]) == ("classification", "classification")
    assert set(manifest["metrics"]) == {"loss", "accuracy", "samples"}
    options = ClassificationOptions(**state["task"]["options"])
    channels, height, width = options.synthetic_image_shape()
    plain = build_model(options.model, channels, (height, width), options.synthetic_classes)
    plain.load_state_dict(state["model"], strict=True)  # no "module." prefixes: DDP is not in the checkpoint


def test_broken_newer_checkpoints_are_skipped_with_reasons_and_training_resumes_exactly(reference, checkpoints,
                                                                                         tmp_path):
    defects = {16: "flipped-bytes", 14: "truncated", 12: "checksum-mismatch", 10: "size-mismatch",
               8: "missing-manifest", 6: "unparseable-manifest", 4: "pickled-object"}
    for step, defect in defects.items():
        break_checkpoint(checkpoints / f"step-{step:08d}", defect, marker=tmp_path / "executed")
    result = trainer(tmp_path, "--keep-last", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = [line.split("skipping checkpoint ", 1)[1] for line in result.stderr.splitlines() if "skipping" in line]
    assert [line.split(":", 1)[0].rsplit("/", 1)[1] for line in skipped] == [f"step-{s:08d}" for s in defects]
    for line, expected in zip(skipped, ["crc32 checksum", "bytes, the manifest says", "crc32 checksum",
                                        "bytes, the manifest says", "no manifest", "not valid JSON",
                                        "Unsupported global"], strict=True):
        assert expected in line, line
    assert not (tmp_path / "executed").exists(), "loading the checkpoint ran its code"
    assert summary(tmp_path)["resumed_from"].endswith("step-00000002")
    assert open_storage(str(checkpoints)).list_checkpoints() == ["step-00000016", "step-00000014", "step-00000012"]
    assert_same_tensors(final_params(checkpoints), final_params(reference))


def test_resume_path_to_a_broken_checkpoint_exits_2_with_one_line(checkpoints, tmp_path):
    break_checkpoint(checkpoints / "step-00000016", "flipped-bytes")
    before = checkpoint_bytes(checkpoints)
    result = trainer(tmp_path, "--resume", str(checkpoints / "step-00000016"))
    assert result.returncode == EXIT_USAGE
    [line] = error_lines(result)
    assert "step-00000016: state.pt does not match the manifest's crc32 checksum" in line and "--resume" in line
    assert checkpoint_bytes(checkpoints) == before


def test_a_checkpoint_of_another_model_exits_2_with_one_line_and_stays(checkpoints, tmp_path):
    before = checkpoint_bytes(checkpoints)
    result = trainer(tmp_path, "--model", "lenet")
    assert result.returncode == EXIT_USAGE
    [line] = error_lines(result)
    assert "was trained with --model convnet and this run asks for lenet, which a resume cannot change" in line
    assert checkpoint_bytes(checkpoints) == before


def test_a_file_where_the_checkpoint_folder_should_be_exits_2_at_start(tmp_path):
    (tmp_path / "checkpoints").write_text("not a folder")
    result = trainer(tmp_path)
    assert result.returncode == EXIT_USAGE
    [line] = error_lines(result)
    assert "a file is in the way" in line and "--checkpoint-dir" in line
    assert "epoch 1" not in result.stderr  # refused before training


def test_a_read_only_checkpoint_folder_exits_2_at_start(mount_point, tmp_path):
    mount_tmpfs("ro,size=1m", mount_point)
    result = trainer(tmp_path, "--checkpoint-dir", str(mount_point / "checkpoints"))
    assert result.returncode == EXIT_USAGE
    [line] = error_lines(result)
    assert "is not writable (Read-only file system)" in line and "--checkpoint-dir" in line


def test_a_full_disk_exits_2_with_one_line_keeping_the_previous_checkpoints(mount_point, tmp_path):
    mount_tmpfs("size=1m", mount_point)  # room for two 0.4 MB checkpoints, not three
    result = trainer(tmp_path, "--checkpoint-dir", str(mount_point), "--keep-last", "3")
    assert result.returncode == EXIT_USAGE
    [line] = error_lines(result)
    assert "could not write checkpoint" in line and "No space left on device" in line and "free space" in line
    storage = open_storage(str(mount_point))
    assert storage.list_checkpoints() == ["step-00000004", "step-00000002"]
    for name in storage.list_checkpoints():
        verify(storage, name)
    assert not [path for path in mount_point.iterdir() if path.name.startswith(".tmp-")]


def test_an_async_run_stopped_and_resumed_ends_identical_to_a_sync_run(reference, tmp_path):
    stopped = trainer(tmp_path, "--async-checkpoint", "--max-steps", "6")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    name, _, _ = newest_checkpoint(tmp_path / "checkpoints")  # the exit waited for the background write
    assert name == "step-00000006"
    resumed = trainer(tmp_path, "--async-checkpoint")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(tmp_path)["resumed_from"].endswith("step-00000006")
    assert_same_tensors(final_params(tmp_path / "checkpoints"), final_params(reference))


def test_every_asynchronous_checkpoint_followed_by_training_equals_the_synchronous_one(reference, tmp_path):
    """The checkpoints of steps 2-14 each have training after them, which goes on while the background thread
    copies the parameters; that copy starts 0.3 s late here (tests/workers/slow_copy.py), so that an optimizer
    step not held back by before_update() would change them first."""
    result = run([sys.executable, "-m", "tests.workers.slow_copy", *COMMON, "--async-checkpoint", "--keep-last", "10",
                  "--output-dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    storage, expected = open_storage(str(tmp_path / "checkpoints")), open_storage(str(reference))
    assert storage.list_checkpoints() == expected.list_checkpoints() and len(storage.list_checkpoints()) == 8
    for name in storage.list_checkpoints():
        written, wanted = verify(storage, name).state, verify(expected, name).state
        assert_same_tensors({part: written.parts[part] for part in ("model", "optimizer")},
                            {part: wanted.parts[part] for part in ("model", "optimizer")}, name)


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_an_fsspec_checkpoint_url_keeps_the_last_k_and_resumes_exactly(scheme, reference, tmp_path, monkeypatch):
    """In this process, so that the memory:// file system is the test's own."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as in the reference run, for bitwise-equal results
    location = f"memory://ckpt-{uuid.uuid4().hex}" if scheme == "memory" else f"file://{tmp_path}/checkpoints"
    args = [*COMMON, "--output-dir", str(tmp_path), "--checkpoint-dir", location, "--keep-last", "2"]
    assert main([*args, "--max-steps", "6"]) == 0
    stopped = open_storage(location).list_checkpoints()
    assert [step_of(name) for name in stopped] == [6, 4]  # memory://: each save's own folder, step-N.<save>
    assert main(args) == 0
    assert summary(tmp_path)["resumed_from"] == f"{location}/{stopped[0]}"
    storage = open_storage(location)
    assert [step_of(name) for name in storage.list_checkpoints()] == [16, 14]
    state = verify(storage, storage.list_checkpoints()[0]).state.to_dict()
    assert_same_tensors({"model": state["model"], "optimizer": state["optimizer"], "position": state["position"]},
                        final_params(reference))


# A checkpoint of format 2, written by the previous release (the fixture's manifest says so): synthetic
# 1x8x8 images, the ConvNet, stopped with --max-steps 5 in the first of two epochs.
FORMAT_2 = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint-format-2"
FORMAT_2_RUN = ["--dataset", "synthetic", "--synthetic-shape", "1,8,8", "--synthetic-train-size", "64",
                "--synthetic-test-size", "32", "--batch-size", "8", "--epochs", "2", "--checkpoint-every", "3",
                "--model", "convnet", "--progress", "off", "--no-tensorboard"]


def as_format_3(loaded_state: TrainingState, checkpoint_dir: Path) -> None:
    """Write a (migrated) state as this trainer writes checkpoints: format 3, a manifest over its file."""
    name = f"step-{loaded_state.position.step:08d}"

    def manifest(files: dict) -> bytes:
        return json.dumps({"format": 3, **loaded_state.manifest(None), "files": files}).encode()

    files = {"state.pt": lambda handle: save_state(loaded_state.to_dict(), handle)}
    open_storage(str(checkpoint_dir)).write(name, files, manifest)


def test_a_checkpoint_of_the_previous_format_migrates_its_tensors_exactly_and_resumes_like_its_migration(tmp_path):
    """The fixture's five steps were computed on another machine, whose CPU may round differently from this one:
    nothing computed here is compared with anything computed there. What is proved: (1) migration keeps every
    tensor and value of the fixture; (2) resuming the format-2 folder trains exactly as resuming the same
    state written in format 3 by this trainer, on this machine."""
    raw = torch.load(FORMAT_2 / "step-00000005" / "state.pt", map_location="cpu", weights_only=True)
    migrated = verify(open_storage(str(FORMAT_2)), "step-00000005").state
    assert_same_tensors(migrated.model, raw["model"])
    assert_same_tensors(migrated.parts["optimizer"], raw["optimizer"])
    assert_same_tensors(migrated.parts["grad_scaler"], raw["scaler"])
    assert_same_tensors(migrated.parts["rng"], raw["rng"])
    assert migrated.position.to_dict() == {key: value for key, value in raw["position"].items()
                                           if key != "best_accuracy"}
    assert (migrated.position.step, migrated.world_size, migrated.task.options["model"]) == (5, 1, "convnet")

    shutil.copytree(FORMAT_2, tmp_path / "old" / "checkpoints")
    as_format_3(migrated, tmp_path / "new" / "checkpoints")
    for run_dir in ("old", "new"):
        result = run([sys.executable, "-m", "trainer", *FORMAT_2_RUN, "--output-dir", str(tmp_path / run_dir)])
        assert result.returncode == 0, result.stderr[-3000:]
        assert summary(tmp_path / run_dir)["resumed_from"].endswith("step-00000005")
    old_name, old_manifest, old_state = newest_checkpoint(tmp_path / "old" / "checkpoints")
    new_name, _, new_state = newest_checkpoint(tmp_path / "new" / "checkpoints")
    assert old_name == new_name == "step-00000016" and old_manifest["format"] == 3
    assert old_state["task"]["options"]["model"] == "convnet"  # migrated from the old config's model section
    assert_same_tensors(old_state["model"], new_state["model"])
    assert_same_tensors(old_state["optimizer"], new_state["optimizer"])


@pytest.mark.parametrize("location", [
    "memory://alice:SECRET1@bucket-{id}/ckpt",  # a password
    "memory://SECRET1@bucket-{id}/ckpt",  # a token as the user name
])  # (a query's and a fragment's tokens: tests/integration/test_data_urls.py, over HTTP)
def test_a_checkpoint_url_s_credentials_reach_no_output_line_nor_file(location, tmp_path, monkeypatch, capfd):
    """In this process (the memory:// file system is the test's own): a stopped run and its resume, whose
    summary names the checkpoint it resumed from; nothing it prints or writes holds the secret."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    location = location.format(id=uuid.uuid4().hex[:8])
    args = [*COMMON, "--output-dir", str(tmp_path), "--checkpoint-dir", location]
    assert main([*args, "--max-steps", "4"]) == 0
    stopped = open_storage(location).list_checkpoints()[0]
    assert main(args) == 0
    assert step_of(stopped) == 4
    assert summary(tmp_path)["resumed_from"] == f"{location.replace('SECRET1', '***')}/{stopped}"
    printed = capfd.readouterr()
    assert "resumed from memory://" in printed.err and "SECRET1" not in printed.out + printed.err
    assert [path for path, content in every_file_under(tmp_path).items() if b"SECRET1" in content] == []


def test_a_password_holding_at_slash_and_question_marks_is_hidden_in_a_failed_save(tmp_path, monkeypatch, capfd):
    """The save fails with the file system quoting its own path, where the URL's pieces are: the one line shows
    none of the password's pieces."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    location = f"memory://alice:PIECE1@PIECE2/PIECE3?PIECE4@bucket-{uuid.uuid4().hex[:8]}/ckpt"
    real_open = MemoryFileSystem._open

    def full_store(self: MemoryFileSystem, path: str, mode: str = "rb", *args: object, **kwargs: object) -> object:
        if "w" in mode and "/step-" in path:
            raise OSError(errno.ENOSPC, f"no room left for {path}")  # a retry cannot fix it: the run ends
        return real_open(self, path, mode, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "_open", full_store)
    assert main([*COMMON, "--output-dir", str(tmp_path), "--checkpoint-dir", location]) == EXIT_USAGE
    printed = capfd.readouterr()
    [line] = [line for line in printed.err.splitlines() if "error:" in line]
    assert line.startswith("[rank 0] error: could not write checkpoint memory://alice:***@bucket-"), line
    assert "PIECE" not in printed.out + printed.err
    assert [path for path, content in every_file_under(tmp_path).items() if b"PIECE" in content] == []
