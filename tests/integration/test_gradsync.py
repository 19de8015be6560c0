"""Gradient synchronisation: every method averages the same gradients, DDP over 2 ranks equals one
process with the doubled batch, and gradient accumulation equals the bigger batch too."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch

from devtools.processes import run, torchrun
from tests.support.checkpoint_reading import newest_checkpoint
from trainer.models import build_model

# LeNet has no BatchNorm, so the loss of a global batch does not depend on how it is split.
BASE = ["--dataset", "synthetic", "--synthetic-train-size", "256", "--synthetic-test-size", "64", "--model",
        "lenet", "--optimizer", "sgd", "--lr", "0.05", "--schedule", "constant", "--epochs", "1", "--max-steps", "6",
        "--progress", "off", "--no-tensorboard", "--resume", "none"]


def model_after(output_dir: Path) -> dict[str, torch.Tensor]:
    _, manifest, state = newest_checkpoint(output_dir / "checkpoints")
    assert manifest["step"] == 6
    return state["model"]


def assert_close(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for key in left:
        torch.testing.assert_close(left[key], right[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """Each configuration trained once, shared by the assertions below."""
    configs = {
        "ddp 2x8": (2, ["--sync", "ddp", "--batch-size", "8"]),
        "allreduce 2x8": (2, ["--sync", "allreduce", "--batch-size", "8"]),
        "reduce-broadcast 2x8": (2, ["--sync", "reduce-broadcast", "--batch-size", "8"]),
        "ddp 2x4 accumulate 2": (2, ["--sync", "ddp", "--batch-size", "4", "--grad-accum-steps", "2"]),
        "single 1x16": (1, ["--batch-size", "16"]),
        "single 1x8 accumulate 2": (1, ["--batch-size", "8", "--grad-accum-steps", "2"]),
    }
    models = {}
    for name, (nproc, args) in configs.items():
        output = tmp_path_factory.mktemp(name.replace(" ", "-"))
        all_args = [*BASE, *args, "--output-dir", str(output)]
        # The two-rank runs record every collective they make (tests/workers/flight_record.py).
        result = torchrun(all_args, nproc=nproc, module="tests.workers.flight_record") if nproc > 1 else \
            run([sys.executable, "-m", "trainer", *all_args])
        assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
        models[name] = model_after(output)
        if nproc > 1:
            models[f"{name} collectives"] = [pickle.loads((output / "flight-recorder" / f"rank-{rank}").read_bytes())
                                             for rank in range(nproc)]
    return models


def test_training_moved_the_parameters_away_from_the_initial_ones(runs):
    torch.manual_seed(0)  # the trainer's --seed 0, set before it builds the model
    initial = build_model("lenet", 1, (28, 28), 10).state_dict()
    assert not torch.equal(initial["features.0.weight"], runs["single 1x16"]["features.0.weight"])


@pytest.mark.parametrize("method", ["allreduce 2x8", "reduce-broadcast 2x8"])
def test_hand_written_methods_give_the_same_parameters_as_ddp(runs, method):
    assert_close(runs[method], runs["ddp 2x8"])


def test_ddp_over_two_ranks_of_batch_b_equals_one_process_of_batch_2b(runs):
    assert_close(runs["ddp 2x8"], runs["single 1x16"])


def test_gradient_accumulation_equals_the_larger_batch(runs):
    assert_close(runs["single 1x8 accumulate 2"], runs["single 1x16"])


def gradient_reductions(record: dict) -> int:
    """DDP's all-reduces of the gradients: the training group's, of one bucket holding all of LeNet's gradients."""
    parameters = sum(tensor.numel() for tensor in build_model("lenet", 1, (28, 28), 10).parameters())
    return sum(1 for entry in record["entries"] if entry["profiling_name"] == "gloo:all_reduce"
               and entry["input_sizes"] == [[parameters]])


def test_accumulation_under_ddp_syncs_once_per_optimizer_step_and_equals_the_larger_batch(runs):
    assert_close(runs["ddp 2x4 accumulate 2"], runs["single 1x16"])
    # 6 optimizer steps of 2 micro-batches: 6 reductions (12 if every micro-batch synchronised), and one for DDP's
    # bucket priming (trainer.gradsync.DDPSync.prime), on each rank.
    assert [gradient_reductions(record) for record in runs["ddp 2x4 accumulate 2 collectives"]] == [7, 7]
    assert [gradient_reductions(record) for record in runs["ddp 2x8 collectives"]] == [7, 7]
