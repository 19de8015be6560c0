"""SyncBatchNorm on CPU/gloo: N ranks with a slice each behave like plain BatchNorm on the whole batch.

The distributed tests start real gloo processes (tests/workers/syncbn_worker.py), then rebuild the same
global batch here and run plain nn.BatchNorm on it as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from devtools.processes import env_ranks
from tests.support.tensors import close
from tests.workers.syncbn_worker import (
    LAYER_CASES,
    STEPS,
    convnet,
    ddp_batch,
    global_batch,
    make_layer,
    run_layer,
    sgd,
    slice_bounds,
)

CPU = torch.device("cpu")
AFFINE_CASES = [name for name in LAYER_CASES if make_layer(name).affine]


# --- real ranks: each layer alone -------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerRun:
    sizes: list[int]
    ranks: list[dict]

    def mine(self, rank: int, global_tensor: Tensor) -> Tensor:
        start, end = slice_bounds(self.sizes, rank)
        return global_tensor[start:end]


def load_ranks(out: Path, world_size: int) -> list[dict]:
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world_size)]


def launch(args: list[str], world_size: int, out: Path) -> list[dict]:
    results = env_ranks([*args, "--out", str(out)], world_size, module="tests.workers.syncbn_worker", timeout_s=240)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stderr[-4000:]}"
    return load_ranks(out, world_size)


@pytest.fixture(scope="module", params=[[4, 4], [5, 1, 3]], ids=["2-ranks-even", "3-ranks-uneven"])
def layer_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LayerRun:
    sizes = request.param
    args = ["layers", "--sizes", ",".join(map(str, sizes))]
    return LayerRun(sizes, launch(args, len(sizes), tmp_path_factory.mktemp("syncbn-layers")))


def reference_run(name: str, total: int) -> dict:
    """Plain BatchNorm on the concatenation of every rank's slice, step for step."""
    layer = make_layer(name)
    steps = [run_layer(layer, *global_batch(name, step, total), LAYER_CASES[name].dtype) for step in range(STEPS)]
    eval_inputs, _ = global_batch(name, STEPS, total)
    with torch.no_grad():
        eval_output = layer.eval()(eval_inputs)
    return {"steps": steps, "running_mean": layer.running_mean, "running_var": layer.running_var,
            "num_batches_tracked": layer.num_batches_tracked, "eval_output": eval_output}


@pytest.mark.parametrize("name", LAYER_CASES)
def test_forward_output_matches_batchnorm_on_the_whole_batch(layer_run: LayerRun, name: str) -> None:
    expected = reference_run(name, sum(layer_run.sizes))
    for rank, result in enumerate(layer_run.ranks):
        assert result[name]["type"] == "GlooSyncBatchNorm"
        for step in range(STEPS):
            output = result[name]["steps"][step]["output"]
            assert output.dtype == LAYER_CASES[name].dtype
            close(output, layer_run.mine(rank, expected["steps"][step]["output"]), LAYER_CASES[name].dtype)


@pytest.mark.parametrize("name", LAYER_CASES)
def test_running_statistics_match_batchnorm_on_the_whole_batch(layer_run: LayerRun, name: str) -> None:
    expected = reference_run(name, sum(layer_run.sizes))
    for result in layer_run.ranks:
        # float32 statistics even from bf16 inputs, so the float32 tolerance applies to every case.
        close(result[name]["running_mean"], expected["running_mean"])
        close(result[name]["running_var"], expected["running_var"])
        assert result[name]["num_batches_tracked"].item() == STEPS


@pytest.mark.parametrize("name", LAYER_CASES)
def test_input_gradients_match_batchnorm_on_the_whole_batch(layer_run: LayerRun, name: str) -> None:
    expected = reference_run(name, sum(layer_run.sizes))
    for rank, result in enumerate(layer_run.ranks):
        for step in range(STEPS):
            grad_input = result[name]["steps"][step]["grad_input"]
            close(grad_input, layer_run.mine(rank, expected["steps"][step]["grad_input"]), LAYER_CASES[name].dtype)


@pytest.mark.parametrize("name", AFFINE_CASES)
def test_local_weight_and_bias_gradients_sum_to_batchnorms(layer_run: LayerRun, name: str) -> None:
    """Each rank's gradients are its share; the all-reduce SUM that DDP performs gives the whole batch's."""
    expected = reference_run(name, sum(layer_run.sizes))
    for step in range(STEPS):
        for key in ("grad_weight", "grad_bias"):
            summed = torch.stack([result[name]["steps"][step][key] for result in layer_run.ranks]).sum(0)
            close(summed, expected["steps"][step][key])


@pytest.mark.parametrize("name", LAYER_CASES)
def test_evaluation_uses_running_statistics_with_no_collective(layer_run: LayerRun, name: str) -> None:
    """Ranks ran different numbers of evaluation batches and still met at the next collective."""
    expected = reference_run(name, sum(layer_run.sizes))
    for rank, result in enumerate(layer_run.ranks):
        close(result[name]["eval_output"], layer_run.mine(rank, expected["eval_output"]), LAYER_CASES[name].dtype)
        assert result["marker"].item() == sum(range(len(layer_run.sizes)))


# --- real ranks: a model under DDP ------------------------------------------------------------------------

DDP_WORLD_SIZE = 2
DDP_PER_RANK = 4


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    args = ["ddp", "--per-rank", str(DDP_PER_RANK)]
    return launch(args, DDP_WORLD_SIZE, tmp_path_factory.mktemp("syncbn-ddp"))


def one_process_training(batch_size: int) -> dict[str, Tensor]:
    model = convnet()
    optimizer = sgd(model)
    for step in range(STEPS):
        images, labels = ddp_batch(step, batch_size)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("group", ["default_group", "dedicated_group"])
def test_ddp_training_matches_one_process_on_the_whole_batch(ddp_ranks: list[dict], group: str) -> None:
    """B samples on each of 2 ranks, mean loss, DDP's gradient average == one process with 2B samples."""
    expected = one_process_training(DDP_PER_RANK * DDP_WORLD_SIZE)
    for result in ddp_ranks:
        assert result[group]["types"].count("GlooSyncBatchNorm") == 2
        state = result[group]["state"]
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            close(state[key], value)
