"""The node's NVIDIA driver against torch's CUDA (trainer.cuda_driver), and what the trainer does with it: refuse
in one line where CUDA cannot start on a driver too old for it, warn where CUDA started anyway, else as before.
Every node here is made up in a temporary folder (tests/support/nvidia_node.py)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.nvidia_node import OPEN_MODULE, PROPRIETARY, fake_node, version_line
from trainer import cuda_driver
from trainer.api import run
from trainer.config import DistConfig
from trainer.cuda_driver import (
    NO_CUDA,
    OK,
    TOO_OLD,
    UNKNOWN,
    NodeSources,
    attached_gpus,
    driver_check,
    driver_in_version_file,
    parse_version,
    start_failure,
    working_cuda_warning,
)
from trainer.distributed import choose_device, init_process_group
from trainer.errors import EXIT_USAGE, DeviceError
from trainer.launchers import identity_from_env

TOO_OLD_FOR_13 = ("NVIDIA driver 535.104.05 is older than 580, the oldest this torch's CUDA 13.0 runs on: update the "
                  "node's driver, or use a torch built for an older CUDA (docs/containers.md)")
LOCAL_RANK3 = identity_from_env({"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                                 "GROUP_RANK": "0", "MASTER_ADDR": "m", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"})


@pytest.mark.parametrize(("text", "version"), [(PROPRIETARY, "535.104.05"), (OPEN_MODULE, "580.65.06")])
def test_the_version_is_read_from_either_kernel_modules_nvrm_line(text, version):
    assert driver_in_version_file(text) == version


@pytest.mark.parametrize("text", [
    "", "garbage\x00\xff", "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n",
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  Sat Aug 19 01:15:15 UTC 2023\n",
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.1O4.05  Sat Aug 19 01:15:15 UTC 2023\n",
])
def test_a_file_without_a_dotted_version_on_its_nvrm_line_gives_none(text):
    assert driver_in_version_file(text) is None


def test_versions_compare_as_numbers_not_as_text():
    assert parse_version("535.104.05") == (535, 104, 5) and parse_version("580") == (580,)
    assert parse_version("535.104.05") < parse_version("580") <= parse_version("580.65.06")  # type: ignore[operator]
    assert parse_version("99.1") < parse_version("535.1")  # type: ignore[operator]
    assert [parse_version(text) for text in ("", "5a.1", "1..2", "-1", "[N/A]")] == [None] * 5


@pytest.mark.parametrize(("cuda", "minimum"), [("11.8", "450.80.02"), ("12.4", "525.60.13"), ("12.9", "525.60.13"),
                                               ("13.0", "580"), ("10.2", None), ("14.0", None), ("odd", None)])
def test_the_minimum_driver_is_nvidias_for_the_cuda_major(cuda, minimum, tmp_path):
    check = driver_check(fake_node(tmp_path, version_line("580.65.06"), cuda=cuda))
    assert check.minimum == minimum
    if minimum is None:
        assert check.verdict == UNKNOWN and f"no minimum driver known for this torch's CUDA {cuda}" in check.describe()


@pytest.mark.parametrize(("driver", "cuda", "verdict"), [
    ("535.104.05", "13.0", TOO_OLD), ("580.65.06", "13.0", OK), ("590.44.01", "13.0", OK),
    ("579.99.99", "13.0", TOO_OLD),
    ("525.60.13", "12.6", OK), ("525.60.12", "12.6", TOO_OLD), ("450.80.02", "11.8", OK), ("450.57", "11.8", TOO_OLD),
])
def test_a_driver_is_too_old_only_below_the_minimum(driver, cuda, verdict, tmp_path):
    assert driver_check(fake_node(tmp_path, version_line(driver), cuda=cuda)).verdict == verdict


def test_a_driver_too_old_says_the_versions_and_the_fix_in_one_line(tmp_path):
    check = driver_check(fake_node(tmp_path, PROPRIETARY))
    assert check.too_old() == TOO_OLD_FOR_13 and check.describe() == TOO_OLD_FOR_13


def test_a_driver_new_enough_is_described_with_where_it_was_read(tmp_path):
    node = fake_node(tmp_path, OPEN_MODULE)
    assert driver_check(node).describe() == (f"NVIDIA driver 580.65.06 ({node.version_file}); this torch's CUDA 13.0 "
                                             f"needs a driver >= 580")


def test_a_node_without_a_driver_is_unknown_and_says_so(tmp_path):
    node = fake_node(tmp_path)
    check = driver_check(node)
    assert check.verdict == UNKNOWN and check.driver is None
    assert check.describe() == (f"no NVIDIA driver found (no {node.version_file}, no {node.nvidia_smi} on PATH); "
                                f"this torch's CUDA 13.0 needs a driver >= 580")


def test_a_cpu_build_of_torch_reads_nothing_and_needs_no_driver(tmp_path):
    check = driver_check(fake_node(tmp_path, PROPRIETARY, cuda=None))
    assert check.verdict == NO_CUDA and check.driver is None
    assert check.describe() == "this torch is a CPU build, without CUDA"


def test_an_unreadable_or_garbled_version_file_is_unknown_never_a_traceback(tmp_path):
    unreadable = fake_node(tmp_path / "a")
    unreadable.version_file.mkdir()  # reading a folder fails with an OSError that is not FileNotFoundError
    garbled = fake_node(tmp_path / "b", "NVRM version: something else entirely\n")
    for node in (unreadable, garbled):
        check = driver_check(node)
        assert check.verdict == UNKNOWN and check.found.startswith("NVIDIA driver version unknown ("), check.found
    assert "unreadable (" in driver_check(unreadable).found
    assert "no driver version in" in driver_check(garbled).found


def test_without_the_file_nvidia_smis_first_line_is_the_version(tmp_path):
    node = fake_node(tmp_path, nvidia_smi="535.104.05\n535.104.05")  # one line per GPU
    check = driver_check(node)
    assert (check.driver, check.found, check.verdict) == ("535.104.05", node.nvidia_smi, TOO_OLD)


def test_the_file_wins_over_nvidia_smi_and_a_garbled_file_falls_back_to_it(tmp_path):
    assert driver_check(fake_node(tmp_path / "a", OPEN_MODULE, nvidia_smi="535.104.05")).driver == "580.65.06"
    assert driver_check(fake_node(tmp_path / "b", "garbage", nvidia_smi="535.104.05")).driver == "535.104.05"


def test_a_failing_nvidia_smi_leaves_the_version_unknown_with_its_words(tmp_path):
    said = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    check = driver_check(fake_node(tmp_path, nvidia_smi=said, smi_exit=9))
    assert check.verdict == UNKNOWN
    assert check.found.startswith("NVIDIA driver version unknown (no ") and f"(exit 9: {said!r})" in check.found


def test_only_numbered_device_files_are_gpus_in_number_order(tmp_path):
    node = fake_node(tmp_path, gpus=11)
    (node.device_dir / "nvidia-uvm").touch()
    assert attached_gpus(node) == [f"nvidia{index}" for index in range(11)]
    assert attached_gpus(fake_node(tmp_path / "none")) == []


def test_device_cuda_on_a_driver_too_old_for_cuda_to_start_is_refused_in_one_line(tmp_path):
    node = fake_node(tmp_path, PROPRIETARY, gpus=4)
    with pytest.raises(DeviceError) as refused:
        choose_device(DistConfig(device="cuda"), LOCAL_RANK3, node=node)
    assert str(refused.value) == f"CUDA cannot start: {TOO_OLD_FOR_13}"


def test_device_auto_with_gpus_attached_is_refused_rather_than_training_on_the_cpu(tmp_path):
    node = fake_node(tmp_path, PROPRIETARY, gpus=2)
    with pytest.raises(DeviceError) as refused:
        choose_device(DistConfig(), LOCAL_RANK3, node=node)
    assert str(refused.value) == ("CUDA cannot start on this node's GPUs (nvidia0, nvidia1), so --device auto would "
                                  f"train on the CPU (--device cpu does so on purpose): {TOO_OLD_FOR_13}")


def test_device_auto_without_gpus_attached_or_device_cpu_still_train_on_the_cpu(tmp_path):
    """A CPU container on a GPU host sees the host's /proc/driver/nvidia, but no GPU device file."""
    assert choose_device(DistConfig(), LOCAL_RANK3, node=fake_node(tmp_path / "a", PROPRIETARY)) == torch.device("cpu")
    with_gpus = fake_node(tmp_path / "b", PROPRIETARY, gpus=4)
    assert choose_device(DistConfig(device="cpu"), LOCAL_RANK3, node=with_gpus) == torch.device("cpu")


def test_cuda_that_started_on_an_old_driver_is_used_not_refused(tmp_path):
    """NVIDIA's forward-compatibility package runs a newer CUDA on an older kernel module."""
    node = fake_node(tmp_path, PROPRIETARY, gpus=4, cuda_devices=4)
    assert choose_device(DistConfig(device="cuda"), LOCAL_RANK3, node=node) == torch.device("cuda", 3)


@pytest.mark.parametrize(("version_file", "cuda", "fact"), [
    (OPEN_MODULE, "13.0", "NVIDIA driver 580.65.06 ({}); this torch's CUDA 13.0 needs a driver >= 580"),
    (None, None, "this torch is a CPU build, without CUDA"),
])
def test_no_cuda_device_without_an_old_driver_keeps_its_message_with_the_driver_fact(version_file, cuda, fact,
                                                                                    tmp_path):
    node = fake_node(tmp_path, version_file, cuda=cuda, gpus=4)
    with pytest.raises(DeviceError) as refused:
        choose_device(DistConfig(device="cuda"), LOCAL_RANK3, node=node)
    assert str(refused.value) == (f"--device cuda but this machine has no CUDA device: "
                                  f"{fact.format(node.version_file)}; use --device cpu or auto")
    assert choose_device(DistConfig(), LOCAL_RANK3, node=node) == torch.device("cpu")


def test_cuda_that_counted_gpus_but_failed_to_start_names_the_old_driver(tmp_path):
    said = RuntimeError("The NVIDIA driver on your system is too old (found version 12020). Please update your GPU "
                        "driver by downloading and installing a new version from the URL: http://www.nvidia.com/...")
    assert start_failure(said, fake_node(tmp_path / "old", PROPRIETARY)) == (
        f"CUDA cannot start (The NVIDIA driver on your system is too old (found version 12020)): {TOO_OLD_FOR_13}")
    assert start_failure(said, fake_node(tmp_path / "new", OPEN_MODULE)) is None
    assert start_failure(said, fake_node(tmp_path / "none")) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs CUDA that fails to start")
def test_joining_on_a_cuda_device_that_fails_to_start_is_refused_only_for_an_old_driver(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_driver, "THIS_NODE", fake_node(tmp_path / "old", PROPRIETARY))
    with pytest.raises(DeviceError, match=r"^CUDA cannot start \(.+\): NVIDIA driver 535.104.05 is older than 580"):
        init_process_group(DistConfig(), identity_from_env({}), torch.device("cuda", 0))
    monkeypatch.setattr(cuda_driver, "THIS_NODE", fake_node(tmp_path / "unknown"))
    with pytest.raises(RuntimeError) as raised:
        init_process_group(DistConfig(), identity_from_env({}), torch.device("cuda", 0))
    assert not isinstance(raised.value, DeviceError)  # torch's own error, as before


def test_cuda_that_started_on_an_old_driver_gets_one_warning_line(tmp_path):
    assert working_cuda_warning(driver_check(fake_node(tmp_path / "old", PROPRIETARY))) == (
        "NVIDIA driver 535.104.05 is older than 580, the oldest this torch's CUDA 13.0 runs on, yet CUDA started "
        "(NVIDIA's forward-compatibility package?): training goes on; if CUDA calls fail, update the node's driver "
        "(docs/containers.md)")
    for node in (fake_node(tmp_path / "new", OPEN_MODULE), fake_node(tmp_path / "none"),
                 fake_node(tmp_path / "cpu", PROPRIETARY, cuda=None)):
        assert working_cuda_warning(driver_check(node)) is None


@pytest.mark.parametrize(("device", "gpus"), [("cuda", 0), ("auto", 1)])
def test_the_trainer_exits_2_with_the_one_line(device, gpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cuda_driver, "THIS_NODE", fake_node(tmp_path / "node", PROPRIETARY, gpus=gpus))

    code = run(argv=["--device", device, "--dataset", "synthetic", "--epochs", "1", "--progress", "off",
                     "--no-tensorboard", "--output-dir", str(tmp_path / "out")])

    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert line.startswith("[rank 0] error: CUDA cannot start") and line.endswith(f": {TOO_OLD_FOR_13}"), line


def test_an_nvidia_smi_that_never_answers_is_given_up_on_not_waited_for(tmp_path):
    # A wedged driver: nvidia-smi hangs. The start goes on with the version unknown, in about the bound.
    smi = tmp_path / "hung-nvidia-smi"
    smi.write_text("#!/bin/sh\nexec sleep 60\n")
    smi.chmod(0o755)
    node = NodeSources(version_file=tmp_path / "absent", nvidia_smi=str(smi), nvidia_smi_timeout_s=0.5,
                       device_dir=tmp_path, cuda_version="13.0", cuda_devices=lambda: 0)
    started = time.monotonic()
    check = driver_check(node)
    assert time.monotonic() - started < 5
    assert check.verdict == UNKNOWN and "no answer in 0.5 s" in check.describe()
