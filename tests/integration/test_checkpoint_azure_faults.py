"""An Azure Blob Storage endpoint that vanishes during a run (Azurite behind a port the test closes: connections
refused, as a killed server's), one process, in this process: a save while it is gone is a warning and training goes
on, the saves after it is back commit; a run whose endpoint never comes back ends to be retried (exit 200), in one
line, within the client's few bounded attempts rather than azure-core's minutes of them."""

from __future__ import annotations

import time

import pytest

from trainer.api import run
from trainer.checkpoint import CheckpointManager, open_storage
from trainer.checkpoint.reading import STATE_FILE
from trainer.checkpoint.storage import FsspecStorage, step_of
from trainer.errors import EXIT_PEER_LOST

# 8 samples a step: 4 steps, a save at every one.
ARGS = ["--dataset", "synthetic", "--synthetic-train-size", "32", "--synthetic-test-size", "8", "--batch-size", "8",
        "--epochs", "1", "--progress", "off", "--no-tensorboard", "--checkpoint-every", "1", "--keep-last", "10",
        "--job-id", "azure-faults"]


def gone_at_step(monkeypatch: pytest.MonkeyPatch, gate, away: int, back: int | None = None) -> None:  # noqa: ANN001
    """The endpoint closes while the save of step ``away`` uploads its state file (opened, its blocks not yet
    staged: adlfs wraps what the upload meets as ``RuntimeError("Failed to upload block: ...")``), and opens again
    as the save of step ``back`` starts."""
    create, save = FsspecStorage._create, CheckpointManager.save

    def create_and_vanish(self, name, filename):  # noqa: ANN001, ANN202 - the backend's signature
        handle = create(self, name, filename)
        if step_of(name) == away and filename == STATE_FILE:
            gate.stop()
        return handle

    def save_once_back(self, state, *rest, **named):  # noqa: ANN001, ANN202 - the manager's signature
        if state.position.step == back and not gate.open:
            gate.start()
        return save(self, state, *rest, **named)

    monkeypatch.setattr(FsspecStorage, "_create", create_and_vanish)
    monkeypatch.setattr(CheckpointManager, "save", save_once_back)


@pytest.mark.timeout(120)  # azure-core's own retries, unbounded, outlast it many times over
def test_a_save_while_the_azure_endpoint_is_gone_is_a_warning_and_the_saves_after_it_is_back_commit(
        azure_gate, monkeypatch, capfd, tmp_path):
    gate, server = azure_gate
    location = f"az://{server.new_container()}/ckpt"
    gone_at_step(monkeypatch, gate, away=2, back=3)
    assert run(argv=[*ARGS, "--checkpoint-dir", location, "--output-dir", str(tmp_path)]) == 0
    log = capfd.readouterr().err
    assert "Traceback" not in log, log[-5000:]
    assert "checkpoint at step 2 not saved (1 of --max-failed-saves 3 in a row): could not write checkpoint" in log, (
        log[-5000:])
    assert "Failed to upload block" in log, log[-5000:]
    saved = sorted(step_of(name) or 0 for name in open_storage(location).list_checkpoints())
    assert saved == [1, 3, 4], saved


@pytest.mark.timeout(120)
def test_a_run_whose_azure_endpoint_never_comes_back_ends_to_be_retried_in_one_line(azure_gate, monkeypatch, capfd,
                                                                                    tmp_path):
    gate, server = azure_gate
    location = f"az://{server.new_container()}/ckpt"
    gone_at_step(monkeypatch, gate, away=2)
    started = time.monotonic()
    code = run(argv=[*ARGS, "--checkpoint-dir", location, "--output-dir", str(tmp_path), "--max-failed-saves", "1"])
    took = time.monotonic() - started
    log = capfd.readouterr().err
    print(f"the run whose endpoint went away at step 2 ended in {took:.0f}s")
    assert code == EXIT_PEER_LOST, log[-5000:]
    assert "Traceback" not in log, log[-5000:]
    [line] = [line for line in log.splitlines() if "error:" in line]
    assert "1 checkpoint save(s) in a row failed (--max-failed-saves 1), the last at step 2" in line, line
