"""The doctor's CUDA driver check (trainer.doctor.driver): a row of the results table on every rank, and one
FAILED line before joining where CUDA cannot start on a driver too old for it. Made-up nodes
(tests/support/nvidia_node.py); the real node's row is in tests/integration/test_doctor.py."""

from __future__ import annotations

import re

import pytest

from tests.support.nvidia_node import OPEN_MODULE, PROPRIETARY, fake_node
from trainer import cuda_driver
from trainer.doctor.checks import FAIL, OK, SKIP
from trainer.doctor.cli import main
from trainer.doctor.driver import OP, driver_outcome
from trainer.errors import EXIT_FAILURE, EXIT_OK

TOO_OLD_FOR_13 = ("NVIDIA driver 535.104.05 is older than 580, the oldest this torch's CUDA 13.0 runs on: update the "
                  "node's driver, or use a torch built for an older CUDA (docs/containers.md)")
QUICK = ["--sizes-mb", "0.01", "--iterations", "1"]


def test_a_driver_new_enough_passes_with_both_versions(tmp_path):
    node = fake_node(tmp_path, OPEN_MODULE, gpus=1, cuda_devices=1)
    outcome = driver_outcome(2, "auto", node)
    assert (outcome.rank, outcome.op, outcome.status) == (2, OP, OK)
    assert outcome.detail == (f"NVIDIA driver 580.65.06 ({node.version_file}); this torch's CUDA 13.0 needs a driver "
                              f">= 580")


@pytest.mark.parametrize(("device", "gpus", "start"), [
    ("cuda", 0, "CUDA cannot start: "),
    ("auto", 2, "CUDA cannot start on this node's GPUs (nvidia0, nvidia1), so --device auto would train on the CPU"),
])
def test_a_driver_too_old_for_cuda_to_start_fails(device, gpus, start, tmp_path):
    outcome = driver_outcome(0, device, fake_node(tmp_path, PROPRIETARY, gpus=gpus))
    assert outcome.status == FAIL and outcome.detail.startswith(start) and outcome.detail.endswith(TOO_OLD_FOR_13)


def test_an_old_driver_on_which_cuda_started_passes_with_the_warning(tmp_path):
    outcome = driver_outcome(0, "cuda", fake_node(tmp_path, PROPRIETARY, gpus=1, cuda_devices=1))
    assert outcome.status == OK and outcome.detail.startswith("NVIDIA driver 535.104.05 is older than 580")
    assert "yet CUDA started" in outcome.detail


@pytest.mark.parametrize(("version_file", "cuda", "device", "gpus", "detail"), [
    (None, None, "auto", 0, "this torch is a CPU build, without CUDA"),
    (None, "13.0", "auto", 0, "no NVIDIA driver found ("),
    (PROPRIETARY, "13.0", "cpu", 4, "--device cpu uses no GPU"),
    (PROPRIETARY, "13.0", "auto", 0, f"no GPU attached here (no /dev/nvidiaN), and {TOO_OLD_FOR_13}"),
])
def test_a_node_where_the_driver_does_not_matter_is_a_skip_that_says_why(version_file, cuda, device, gpus, detail,
                                                                          tmp_path):
    outcome = driver_outcome(0, device, fake_node(tmp_path, version_file, cuda=cuda, gpus=gpus))
    assert outcome.status == SKIP and outcome.detail.startswith(detail), outcome.detail


def test_the_doctor_stops_before_joining_with_one_failed_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cuda_driver, "THIS_NODE", fake_node(tmp_path, PROPRIETARY, gpus=1))

    code = main([*QUICK, "--device", "cuda"])

    out, err = capsys.readouterr()
    assert code == EXIT_FAILURE and out == "", out
    assert err == f"ddp-doctor: rank 0: FAILED: CUDA driver: CUDA cannot start: {TOO_OLD_FOR_13}\n"


@pytest.mark.parametrize(("version_file", "cuda", "row"), [
    (OPEN_MODULE, "13.0", r"ok\s+0\.00\s+NVIDIA driver 580\.65\.06 \(.+\); this torch's CUDA 13\.0 needs a driver "
                          r">= 580"),
    (None, None, r"skip\s+0\.00\s+this torch is a CPU build, without CUDA"),
])
def test_the_report_has_the_drivers_row_and_the_run_passes(version_file, cuda, row, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cuda_driver, "THIS_NODE", fake_node(tmp_path, version_file, cuda=cuda))

    code = main(QUICK)

    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert re.search(rf"^all\s+{OP}\s+{row}$", out, re.MULTILINE), out
    assert "every check passed on 1 rank(s)" in out
