"""trainer.gpu: the settings a CUDA run adds, decided without a GPU (the GPU suite runs them on one)."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch
from torch import nn

from tests.support.data_files import write_image_folder
from trainer.build import build_training
from trainer.cli import parse_config
from trainer.config import DistConfig
from trainer.distributed import Runtime, destroy_process_group, init_process_group, nccl_timeout_s
from trainer.errors import TaskError
from trainer.flight_recorder import (
    apply_recorder_environment,
    dump_flight_recorder,
    reading_advice,
    recorder_environment,
)
from trainer.gpu import choose_tuning, nccl_environment, nccl_timeout_advice, set_tf32
from trainer.launchers import identity_from_env
from trainer.liveness import PROGRESS_GRACE_S

ONE_PROCESS = Runtime(identity_from_env({}), torch.device("cpu"), "gloo")
CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it
CONV = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten())
MLP = nn.Sequential(nn.Linear(4, 2))


def test_auto_turns_channels_last_and_the_autotuner_on_for_cuda_convolutions_only():
    assert (choose_tuning("auto", "auto", CUDA, CONV).channels_last, choose_tuning("auto", "auto", CUDA, CONV)
            .cudnn_benchmark) == (True, True)
    assert choose_tuning("auto", "auto", CUDA, MLP).channels_last is False
    cpu = choose_tuning("auto", "auto", torch.device("cpu"), CONV)
    assert (cpu.channels_last, cpu.cudnn_benchmark) == (False, False)
    forced = choose_tuning("on", "off", torch.device("cpu"), MLP)
    assert (forced.channels_last, forced.cudnn_benchmark) == (True, False)


def test_channels_last_reaches_the_model_and_every_4d_input_of_a_nested_batch():
    tuning = choose_tuning("on", "auto", torch.device("cpu"), CONV)
    image, sequence = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4)
    batch = tuning.inputs({"image": image, "parts": [sequence, (image,)]})
    assert batch["image"].is_contiguous(memory_format=torch.channels_last)
    assert batch["parts"][0] is sequence
    assert batch["parts"][1][0].is_contiguous(memory_format=torch.channels_last)
    off = choose_tuning("off", "auto", torch.device("cpu"), CONV)
    assert off.inputs(image) is image


def test_a_run_with_channels_last_on_builds_an_nhwc_model_and_feeds_it_nhwc_batches(tmp_path):
    config, task = parse_config(["--dataset", "synthetic", "--synthetic-train-size", "16", "--synthetic-test-size",
                                 "8", "--batch-size", "4", "--channels-last", "on", "--output-dir", str(tmp_path)])
    setup = build_training(config, task, ONE_PROCESS)
    convolutions = [module for module in setup.model.modules() if isinstance(module, nn.Conv2d)]
    assert convolutions and all(conv.weight.is_contiguous(memory_format=torch.channels_last) for conv in convolutions)
    inputs, _ = next(iter(setup.train_loader))
    assert setup.inputs_on_device(inputs).is_contiguous(memory_format=torch.channels_last)
    assert setup.tuning.cudnn_benchmark is False  # auto, on a CPU


@pytest.mark.parametrize("dataset", ["synthetic", "imagefolder"])
def test_images_cross_to_the_device_as_uint8_and_are_normalised_there_as_on_the_host(tmp_path, dataset):
    """What the loader hands to the copy is what crosses the bus: one byte a pixel (float32 would be four), pinned
    on CUDA; the task's on_device step gives the model exactly the float32 images the host would have made."""
    flags = ["--synthetic-shape", "3,8,8", "--synthetic-train-size", "16", "--synthetic-test-size", "8"]
    if dataset == "imagefolder":
        write_image_folder(tmp_path / "images", {"a": 4, "b": 4}, size=(10, 12))
        flags = ["--data-dir", str(tmp_path / "images"), "--image-size", "8", "--eval-fraction", "0.25"]
    config, task = parse_config(["--dataset", dataset, *flags, "--batch-size", "4", "--num-workers", "0",
                                 "--output-dir", str(tmp_path / "run")])
    setup = build_training(config, task, ONE_PROCESS)
    inputs, _ = next(iter(setup.train_loader))
    assert inputs.dtype == torch.uint8 and inputs.nbytes // len(inputs) == 3 * 8 * 8
    for loader in (setup.train_loader, setup.eval_loader):
        assert loader.pin_memory is False  # True on CUDA: trainer.build pins for a CUDA device
    on_host = setup.data.train
    prepared = setup.inputs_on_device(inputs)
    assert prepared.dtype == torch.float32
    torch.testing.assert_close(prepared, on_host.normalise(inputs), rtol=0, atol=0)
    expected = (inputs.float() / 255 - torch.tensor(on_host.normalise.mean).view(3, 1, 1)) / torch.tensor(
        on_host.normalise.std).view(3, 1, 1)
    torch.testing.assert_close(prepared, expected)


def test_under_fsdp_channels_last_reaches_the_activations_and_the_sharded_parameters_stay_contiguous(tmp_path):
    """FSDP2 refuses non-contiguous parameters (NotImplementedError): the model keeps its layout and the inputs
    turn NHWC, which each convolution keeps for its output. A training step runs."""
    config, task = parse_config(["--dataset", "synthetic", "--synthetic-shape", "3,12,12", "--synthetic-train-size",
                                 "16", "--synthetic-test-size", "8", "--batch-size", "4", "--channels-last", "on",
                                 "--sync", "fsdp", "--output-dir", str(tmp_path)])
    runtime = init_process_group(DistConfig(), identity_from_env({}), torch.device("cpu"))
    try:
        setup = build_training(config, task, runtime)
        assert setup.tuning.describe().startswith("channels-last on (activations only")
        assert all(parameter.to_local().is_contiguous() for parameter in setup.model.parameters())
        layouts = []
        for module in setup.model.modules():
            if isinstance(module, nn.Conv2d):
                module.register_forward_hook(lambda _, __, output: layouts.append(
                    output.is_contiguous(memory_format=torch.channels_last) and not output.is_contiguous()))
        inputs, targets = next(iter(setup.train_loader))
        setup.instance.loss(setup.model(setup.inputs_on_device(inputs)), targets).backward()
        assert layouts and all(layouts)
    finally:
        destroy_process_group()


def test_under_fsdp_a_model_that_fails_in_both_layouts_keeps_contiguous_weights_for_the_first_batch_check(tmp_path):
    """The channels-last probe puts the chosen layout back when the model fails in both: under FSDP that is the
    contiguous weights (FSDP2 would refuse others with a traceback), and the first-batch check names the error."""
    config, task = parse_config(["--task", "tests.support.tasks:WrongSizeTask", "--batch-size", "4", "--num-workers",
                                 "0", "--channels-last", "on", "--sync", "fsdp", "--output-dir", str(tmp_path)])
    runtime = init_process_group(DistConfig(), identity_from_env({}), torch.device("cpu"))
    try:
        setup = build_training(config, task, runtime)
        assert all(parameter.to_local().is_contiguous() for parameter in setup.model.parameters())
    finally:
        destroy_process_group()


def test_tf32_follows_the_precision_flag_and_every_way_to_read_it_still_works():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        assert set_tf32("tf32") == "TF32 on for float32 matmuls, convolutions and RNNs"
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert (torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision) == ("tf32",) * 2
        for precision in ("fp32", "bf16", "fp16"):
            assert set_tf32(precision) == "TF32 off for float32 matmuls, convolutions and RNNs"
            # Read through the old API (torch.compile does) and the new: neither raises, both say off.
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
            assert "tf32" not in (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision,
                                  torch.backends.cudnn.rnn.fp32_precision)
            with torch.backends.cudnn.flags(enabled=True):
                pass
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_the_nccl_and_flight_recorder_defaults_leave_the_users_own_settings_alone(tmp_path):
    added = recorder_environment({"TORCH_FR_BUFFER_SIZE": "50"}, str(tmp_path / "run"))
    assert "TORCH_FR_BUFFER_SIZE" not in added and added["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert added["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / "flight-recorder" / "rank-")
    assert added["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == added["TORCH_FR_DUMP_TEMP_FILE"]
    nccl = nccl_environment({"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"})
    assert nccl == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def test_nccl_s_watchdog_fires_after_the_trainers_own_diagnosis():
    """NCCL aborts the process at its timeout without naming a late rank: it must come after the gloo
    collectives' timeout and the progress watchdog's (PROGRESS_GRACE_S later), with room for the diagnosis."""
    for collective_timeout_s in (4, 600, 3600):
        assert nccl_timeout_s(collective_timeout_s) >= collective_timeout_s + PROGRESS_GRACE_S + 20
    assert nccl_timeout_s(600) == 660 and nccl_timeout_s(3600) == 3960


def test_the_flight_recorder_folder_is_made_and_each_rank_s_record_dumped_there(tmp_path):
    environ: dict[str, str] = {}
    apply_recorder_environment(environ, str(tmp_path / "run"))
    assert (tmp_path / "run" / "flight-recorder").is_dir()
    dumped = dump_flight_recorder(environ, rank=3)
    assert dumped == tmp_path / "run" / "flight-recorder" / "rank-3"
    assert set(pickle.loads(dumped.read_bytes())) >= {"version", "entries"}
    advice = reading_advice(dumped.parent)
    assert f"`torchfrtrace {tmp_path}/run/flight-recorder -p rank-`" in advice
    assert "NCCL_DEBUG=INFO" in nccl_timeout_advice()


def test_the_autotuner_setting_is_applied_to_cudnn():
    before = torch.backends.cudnn.benchmark
    try:
        choose_tuning("off", "on", torch.device("cpu"), MLP).apply(MLP)
        assert torch.backends.cudnn.benchmark is True
        choose_tuning("off", "off", torch.device("cpu"), MLP).apply(MLP)
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.backends.cudnn.benchmark = before


VIEW_TASK = ["--task", "tests.support.tasks:ViewTask", "--batch-size", "4", "--num-workers", "0"]


def test_a_model_that_cannot_run_channels_last_stops_with_one_line_when_asked_for_it(tmp_path):
    config, task = parse_config([*VIEW_TASK, "--channels-last", "on", "--output-dir", str(tmp_path)])
    with pytest.raises(TaskError) as raised:
        build_training(config, task, ONE_PROCESS)
    message = str(raised.value)
    assert "--channels-last on: the model's forward pass fails in channels-last memory layout" in message
    assert "view size is not compatible" in message and "pass --channels-last off" in message


def test_a_model_that_cannot_run_channels_last_falls_back_under_auto_with_a_warning(tmp_path, caplog):
    """auto chooses channels-last for a conv model on CUDA; here a checkpoint's layout makes it choose so on CPU."""
    config, task = parse_config([*VIEW_TASK, "--output-dir", str(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="trainer"):
        setup = build_training(config, task, ONE_PROCESS, trained_channels_last=True)
    assert setup.tuning.channels_last is False
    assert all(parameter.is_contiguous() for parameter in setup.model.parameters())
    assert "fails in channels-last memory layout" in caplog.text and "training in the default layout" in caplog.text
    inputs, _ = next(iter(setup.train_loader))
    setup.model(setup.inputs_on_device(inputs))  # trains in the default layout


def test_a_dataset_a_user_registers_is_fed_to_the_model_as_it_comes(tmp_path, monkeypatch):
    """Only the trainer's own image datasets cross as uint8 for on_device normalising; a loader added to
    trainer.data.DATASETS that returns, say, a TensorDataset of floats trains unchanged."""
    from torch.utils.data import TensorDataset

    from trainer.data import DATASETS, DatasetInfo

    def tensors(options: object, runtime: Runtime, seed: int) -> tuple:
        images, labels = torch.rand(16, 1, 8, 8), torch.arange(16) % 2
        return TensorDataset(images, labels), TensorDataset(images[:8], labels[:8]), DatasetInfo("t", 1, (8, 8), 2)

    monkeypatch.setattr(DATASETS, "_entries", dict(DATASETS._filled()))  # the registry as it was, after the test
    DATASETS.add("user-tensors", tensors, "a user's own loader")
    config, task = parse_config(["--dataset", "user-tensors", "--batch-size", "4", "--output-dir", str(tmp_path)])
    setup = build_training(config, task, ONE_PROCESS)
    assert setup.data.on_device is None
    inputs, _ = next(iter(setup.train_loader))
    assert inputs.dtype == torch.float32 and setup.model(setup.inputs_on_device(inputs)).shape == (4, 2)
