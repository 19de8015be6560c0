"""FLOPs per sample counted once (torch.utils.flop_counter), FLOP/s per device and MFU against the device's peak."""

from __future__ import annotations

import json
import re
import threading
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import trainer.api
import trainer.build
from trainer.cli import parse_config
from trainer.errors import ConfigError
from trainer.gradsync import unwrap
from trainer.syncbn import GlooSyncBatchNorm
from trainer.throughput import FlopCount, Peak, Throughput, count_flops, device_peak, meta_copy, peak_for

# The built-in ConvNet on 1x28x28 images, per sample: conv1 (1 -> 16 channels, 5x5, 28x28 out) forward 2*1*16*25*784,
# backward its weight's gradient only (the images need none); conv2 (16 -> 32, 5x5, 14x14 out) forward
# 2*16*32*25*196, backward weight and input, twice that; the classifier (1568 -> 10) 2*1568*10, three times.
CONVNET_FLOPS = 2 * (2 * 16 * 25 * 784) + 3 * (2 * 16 * 32 * 25 * 196) + 3 * (2 * 1568 * 10)


def counted(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> FlopCount:
    return count_flops(model, lambda: (inputs, targets), nn.functional.mse_loss, nullcontext)


def test_a_linear_layer_on_the_data_costs_two_products_per_sample_forward_and_one_backward():
    # Forward 2*in*out per sample; backward only the weight's gradient (the data needs none): 2*in*out again.
    # The bias's add and its gradient's sum are element-wise work, which the counter does not count.
    result = counted(nn.Linear(8, 4), torch.randn(3, 8), torch.randn(3, 4))
    assert result.flops_per_sample == 4 * 8 * 4


def test_a_later_layer_costs_three_products_per_sample_its_input_needs_a_gradient():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    result = counted(model, torch.randn(5, 8), torch.randn(5, 4))
    assert result.flops_per_sample == 4 * 8 * 16 + 6 * 16 * 4
    assert result.said.startswith("896 FLOP per sample (forward and backward, counted by torch.utils.flop_counter "
                                  "on one batch of 5, on the meta device, in ")


def test_the_meta_model_of_meta_init_is_counted_as_the_real_one_would_be():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    result = counted(model, torch.randn(5, 8), torch.randn(5, 4))
    assert result.flops_per_sample == 4 * 8 * 16 + 6 * 16 * 4


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict(keep_vars=True).items()}


def unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict(keep_vars=True)
    return now.keys() == before.keys() and all(torch.equal(now[name], before[name]) for name in before)


def test_the_count_leaves_no_trace_in_gradients_buffers_or_random_generators():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4))
    inputs, targets = torch.randn(6, 8), torch.randn(6, 4)
    before = state_of(model)
    generator = torch.get_rng_state()

    result = counted(model, inputs, targets)

    assert result.flops_per_sample == 4 * 8 * 16 + 6 * 16 * 4
    assert unchanged(model, before)
    assert torch.equal(torch.get_rng_state(), generator)
    assert all(parameter.grad is None for parameter in model.parameters())


class RecordsWhereItRuns(nn.Linear):
    def __init__(self, seen: list[tuple[nn.Module, torch.device]]) -> None:
        super().__init__(8, 4)
        self.record = seen.append  # a builtin method: a copy of the module still records into ``seen``

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.record((self, inputs.device))
        return super().forward(inputs)


def test_the_pass_runs_on_a_meta_copy_never_on_the_model_or_its_device():
    # Under --sync fsdp the model is whole until wrapped: a pass on it would hold the whole model's activations
    # and gradients on the device, which training (sharded) never does.
    seen: list[tuple[nn.Module, torch.device]] = []
    model = RecordsWhereItRuns(seen)
    assert counted(model, torch.randn(3, 8), torch.randn(3, 4)).flops_per_sample == 2 * 2 * 8 * 4
    [(module, device)] = seen
    assert module is not model and device == torch.device("meta")


class RegistersABuffer(nn.Linear):
    """Registers a buffer in its first forward (a lazily made cache)."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "cache"):
            self.register_buffer("cache", torch.zeros(inputs.shape[1], device=inputs.device))
        return super().forward(inputs)


class ReshapesItsBuffer(nn.Linear):
    """Replaces its buffer with one of another shape in forward (a cache sized by the batch)."""

    def __init__(self) -> None:
        super().__init__(8, 4)
        self.register_buffer("cache", torch.arange(4.0))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.cache = torch.zeros(inputs.shape[0], 4, device=inputs.device)
        return super().forward(inputs)


class UpdatesAFrozenParameter(nn.Linear):
    """Keeps a running count in a Parameter that needs no gradient, updated under no_grad."""

    def __init__(self) -> None:
        super().__init__(8, 4)
        self.count = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.count += 1
        return super().forward(inputs)


def renormalising_embedding() -> nn.Module:
    """nn.Embedding(max_norm=...) renormalises the rows it looks up in place, in its forward."""
    embedding = nn.Embedding(10, 8, max_norm=1.0)
    nn.init.normal_(embedding.weight, std=10.0)
    return nn.Sequential(embedding, nn.Linear(8, 4))


@pytest.mark.parametrize("make", [lambda: RegistersABuffer(8, 4), ReshapesItsBuffer, UpdatesAFrozenParameter],
                         ids=["registers-a-buffer", "reshapes-its-buffer", "updates-a-frozen-parameter"])
def test_a_forward_that_changes_its_module_leaves_the_model_as_it_was(make):
    model = make()
    before = state_of(model)
    result = counted(model, torch.randn(3, 8), torch.randn(3, 4))
    assert result.flops_per_sample == 2 * 2 * 8 * 4, result.said
    assert unchanged(model, before)


def test_an_embedding_that_renormalises_in_place_keeps_its_weights():
    model = renormalising_embedding()
    before = state_of(model)
    result = counted(model, torch.tensor([[1], [2], [3]]), torch.randn(3, 1, 4))
    assert result.flops_per_sample == 3 * 2 * 8 * 4, result.said  # the Linear's input (the embedding) needs a gradient
    assert unchanged(model, before)


class TiedLanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens))


def test_the_meta_copy_keeps_tied_weights_tied_and_synchronised_batchnorm_local():
    model = nn.Sequential(nn.Linear(8, 8), nn.SyncBatchNorm(8), GlooSyncBatchNorm(8))
    model[2].weight.requires_grad_(False)
    shadow = meta_copy(model)
    assert [type(layer).__name__ for layer in shadow] == ["Linear", "_LocalBatchNorm", "_LocalBatchNorm"]
    assert all(tensor.is_meta for tensor in (*shadow.parameters(), *shadow.buffers()))
    assert [p.requires_grad for p in shadow.parameters()] == [p.requires_grad for p in model.parameters()]
    assert not any(tensor.is_meta for tensor in (*model.parameters(), *model.buffers()))
    tied = meta_copy(TiedLanguageModel())
    assert tied.head.weight is tied.embedding.weight and tied.head.weight.is_meta
    result = counted(TiedLanguageModel(), torch.tensor([[1], [2]]), torch.randn(2, 1, 16))
    assert result.flops_per_sample == 3 * 2 * 8 * 16, result.said  # the head: forward, weight and input gradients


class OpaqueKernel(nn.Module):
    """A layer like a custom extension's kernel that reads raw memory: it cannot run under a dispatch mode."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if _get_current_dispatch_mode() is not None:
            raise RuntimeError("opaque_kernel has no implementation for a dispatch mode")
        return inputs * self.weight


def test_a_model_the_counter_cannot_run_gets_one_line_and_no_count():
    model = nn.Sequential(nn.BatchNorm1d(4), OpaqueKernel())
    before = {name: value.clone() for name, value in model.state_dict().items()}
    result = counted(model, torch.randn(3, 4), torch.randn(3, 4))
    assert result == FlopCount(None, "FLOPs not counted (torch.utils.flop_counter could not run the model's forward "
                                     "and backward on the meta device: RuntimeError: opaque_kernel has no "
                                     "implementation for a dispatch mode; see docs/tasks.md); no FLOP/s or MFU "
                                     "reported")
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_a_model_that_cannot_be_copied_gets_one_line_and_no_count():
    class HoldsALock(nn.Linear):
        def __init__(self) -> None:
            super().__init__(8, 4)
            self.lock = threading.Lock()  # deepcopy cannot copy a lock

    result = counted(HoldsALock(), torch.randn(3, 8), torch.randn(3, 4))
    assert result.flops_per_sample is None
    assert result.said.startswith("FLOPs not counted (torch.utils.flop_counter could not run the model's forward "
                                  "and backward on the meta device: TypeError: cannot pickle '_thread.lock' object")


def test_a_model_whose_work_the_counter_does_not_see_reports_none_rather_than_zero():
    result = count_flops(nn.Sequential(nn.Flatten(), OpaqueScale()), lambda: (torch.randn(3, 4), torch.randn(3, 4)),
                         nn.functional.mse_loss, nullcontext)
    assert result.flops_per_sample is None and "saw no matrix product or convolution" in result.said


class OpaqueScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs * self.weight  # element-wise: no FLOPs the counter counts


@pytest.mark.parametrize(("name", "precision", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5),  # the SXM part
    ("NVIDIA H100 80GB HBM3", "tf32", 494.5),
    ("NVIDIA H100 80GB HBM3", "fp32", 67),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 NVL", "fp16", 835.5),
    ("NVIDIA H200", "bf16", 989.5),
    ("NVIDIA H200 NVL", "bf16", 835.5),
    ("NVIDIA GH200 480GB", "bf16", 989.5),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312),
    ("NVIDIA A100-SXM4-40GB", "tf32", 156),
    ("NVIDIA A100-PCIE-40GB", "bf16", 312),
    ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
    ("NVIDIA A10", "bf16", 125),
    ("NVIDIA A30", "bf16", 165),
    ("NVIDIA L4", "bf16", 121),
    ("NVIDIA L40S", "bf16", 362.05),
    ("NVIDIA L40", "bf16", 181.05),
    ("Tesla V100-SXM2-16GB", "fp16", 125),
    ("Tesla V100-PCIE-32GB", "fp16", 112),
    ("Tesla V100S-PCIE-32GB", "fp16", 130),
    ("Tesla V100-SXM2-32GB", "tf32", 15.7),  # no TF32 on Volta: fp32's figure
    ("Tesla T4", "fp16", 65),
])
def test_a_gpu_named_as_torch_names_it_has_its_dense_peak_at_the_runs_precision(name, precision, tflops):
    peak = peak_for(name, precision)
    assert peak.tflops == tflops
    assert peak.said.startswith(f"MFU against {tflops:g} TFLOP/s, the dense {precision} peak of {name} (NVIDIA ")


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA A100-SXM4-40GB MIG 3g.20gb"])
def test_a_mig_slice_has_no_peak_the_whole_gpus_would_understate_its_mfu(name):
    assert peak_for(name, "bf16") == Peak(None, f"no MFU: {name} is a MIG slice, whose share of the GPU's peak no "
                                                f"datasheet gives; --peak-tflops gives one")
    assert peak_for(name, "bf16", 140.0).tflops == 140.0


def test_a_gpu_without_bf16_tensor_cores_has_no_bf16_peak():
    peak = peak_for("Tesla T4", "bf16")
    assert peak.tflops is None and peak.said.startswith("no MFU: Tesla T4 has no bf16 figure in its datasheet")


def test_a_cpu_has_no_peak():
    assert device_peak(torch.device("cpu"), "bf16") == Peak(
        None, "no MFU: no peak is claimed for CPUs (--peak-tflops gives one)")


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA B200", "NVIDIA GeForce RTX 4090", "NVIDIA RTX A1000"])
def test_an_unknown_gpu_has_no_peak_and_a_line_saying_how_to_add_one(name):
    assert peak_for(name, "bf16") == Peak(
        None, f"no MFU: no peak known for {name!r} at --precision bf16; give one device's dense peak (its "
              f"datasheet's, without sparsity) with --peak-tflops, or add the device to PEAKS in trainer/throughput.py")


def test_a_peak_given_by_hand_wins_over_the_table_and_counts_on_a_cpu_too():
    assert peak_for("NVIDIA A10G", "bf16", 70.0) == Peak(70.0, "MFU against --peak-tflops 70")
    assert device_peak(torch.device("cpu"), "fp32", 1.5).tflops == 1.5


def test_a_negative_peak_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^--peak-tflops must be a number of TFLOP/s >= 0 \(0: from the table\), "
                                          r"got -1$"):
        parse_config(["--peak-tflops", "-1"])


def test_mfu_is_the_flops_one_device_achieves_over_its_peak():
    # 1 GFLOP per sample at 200,000 samples/s over 4 devices: 50 TFLOP/s each, half of a 100 TFLOP/s peak.
    throughput = Throughput(1e9, Peak(100.0, ""), devices=4)
    assert throughput.flops_per_s_per_device(2e5) == 5e13
    assert throughput.mfu(2e5) == 0.5
    assert throughput.shown(2e5) == " (50 TFLOP/s per device, MFU 50.0%)"
    assert throughput.record(2e5) == {"flops_per_s_per_device": 5e13, "mfu": 0.5}
    assert throughput.summary(2e5) == {"flops_per_sample": 1_000_000_000, "train_flops_per_s_per_device": 5e13,
                                       "peak_tflops": 100.0, "train_mfu": 0.5}


def test_without_a_peak_the_flops_are_shown_and_no_mfu():
    throughput = Throughput(1e9, Peak(None, "no MFU"), devices=1)
    assert throughput.shown(2e3) == " (2 TFLOP/s per device)"
    assert throughput.record(2e3) == {"flops_per_s_per_device": 2e12}
    assert throughput.summary(2e3) == {"flops_per_sample": 1_000_000_000, "train_flops_per_s_per_device": 2e12}


def test_without_a_count_nothing_is_shown_or_recorded():
    throughput = Throughput(None, Peak(100.0, ""), devices=1)
    assert throughput.shown(2e3) == "" and throughput.record(2e3) == {} and throughput.summary(2e3) == {}


# -- the real trainer, one process ----------------------------------------------------------------------------------

SYNTHETIC = ["--dataset", "synthetic", "--synthetic-train-size", "64", "--synthetic-test-size", "16"]
TOKENS = ["--task", "tests.support.tasks:TokenTask", "--train-size", "64", "--eval-size", "16"]  # dropout


def train_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, flags: list[str], count: bool = True
               ) -> dict[str, torch.Tensor]:
    """A short run of the trainer; the model's state at its end."""
    built = []

    def build_and_keep(*args: Any, **kwargs: Any) -> Any:
        built.append(real_build(*args, **kwargs))
        return built[-1]

    real_build = trainer.api.build_training
    with monkeypatch.context() as patch:
        patch.setattr(trainer.api, "build_training", build_and_keep)
        if not count:
            patch.setattr(trainer.build, "count_flops", lambda *_: FlopCount(None, "not counted"))
        code = trainer.api.run(argv=[*flags, "--epochs", "1", "--batch-size", "16", "--log-every", "2",
                                     "--progress", "off", "--no-tensorboard", "--output-dir", str(tmp_path)])
    assert code == 0
    return {name: value.clone() for name, value in unwrap(built[0].model).state_dict().items()}


@pytest.mark.parametrize("flags", [SYNTHETIC, TOKENS], ids=["batchnorm", "dropout"])
def test_a_run_with_the_count_trains_bitwise_as_one_without_it(flags, tmp_path, monkeypatch):
    counted_run = train_once(tmp_path / "counted", monkeypatch, flags)
    plain_run = train_once(tmp_path / "plain", monkeypatch, flags, count=False)
    assert counted_run.keys() == plain_run.keys()
    different = [name for name, value in counted_run.items() if not torch.equal(value, plain_run[name])]
    assert different == []


def test_the_log_line_metrics_and_summary_carry_the_flops_and_the_mfu(tmp_path, monkeypatch, capsys):
    train_once(tmp_path, monkeypatch, [*SYNTHETIC, "--peak-tflops", "0.001"])

    log = capsys.readouterr().err
    assert (f"throughput: {CONVNET_FLOPS / 1e6:.3g} MFLOP per sample (forward and backward, counted by "
            f"torch.utils.flop_counter on one batch of 16, on the meta device, in ") in log
    assert "s); MFU against --peak-tflops 0.001\n" in log
    assert re.search(r"\] INFO epoch 1/1 step 2 loss [\d.]+ accuracy [\d.]+ lr \S+ [\d,]+ samples/s "
                     r"\([\d.]+ [kMG]FLOP/s per device, MFU [\d.]+%\)\n", log), log
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [record for record in records if record["kind"] == "train"]
    assert len(train) == 2 and all(
        record["flops_per_s_per_device"] == pytest.approx(CONVNET_FLOPS * record["samples_per_s"])
        and record["mfu"] == pytest.approx(record["flops_per_s_per_device"] / 1e9) for record in train)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["flops_per_sample"] == CONVNET_FLOPS
    assert summary["train_flops_per_s_per_device"] == pytest.approx(CONVNET_FLOPS * summary["train_samples_per_s"],
                                                                    rel=1e-2)
    assert summary["peak_tflops"] == 0.001
    assert summary["train_mfu"] == pytest.approx(summary["train_flops_per_s_per_device"] / 1e9, abs=1e-4)
