"""Before training: every rank runs the task once on its first batch of each split, then all ranks agree.

A dataset item of the wrong type or shape, a model that does not fit the data, a loss that is not a
number, or a metric that fails would otherwise surface mid-run, on one rank, while the others wait in a
collective. Here each becomes one line (naming the item's index where one is at fault) on every rank,
before anything is trained or saved. Nothing here changes what training does next: the model is run
in evaluation mode without gradients (no BatchNorm statistics move, no collective runs but a sharded
model's gathers), and the
random generators are restored afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from trainer.build import TrainingSetup
from trainer.distributed import Runtime, agreed
from trainer.errors import TaskError
from trainer.evaluation import detached
from trainer.gradsync import unwrap
from trainer.items import check_items
from trainer.rng import isolated
from trainer.sampler import SeededItems
from trainer.task import batch_size, call_task, to_device


def check_first_batches(setup: TrainingSetup, runtime: Runtime) -> None:
    """Two agreements: the first batches are built on every rank, then the model runs on them. Under a sharded
    sync every forward pass is collective, so no rank may be missing from it: a rank whose data failed has told
    the others before any of them starts one, and a rank with no evaluation batch runs on a stand-in."""
    def batches() -> list[tuple[str, Any, Any]]:
        built = []
        with isolated(), torch.no_grad():
            for split, loader in (("training", setup.train_loader), ("evaluation", setup.eval_loader)):
                keys = _first_keys(loader)
                if keys:
                    built.append((split, *_first_batch(setup, runtime, split, loader, keys)))
                elif setup.sync.sharded:  # only as the others' partner in the collective forward
                    built.append(("", *_first_batch(setup, runtime, split, loader, [0])))
        return built

    prepared = agreed(runtime, batches, TaskError)

    def run_model() -> None:
        with isolated(), torch.no_grad():
            for split, inputs, targets in prepared:
                _check_model(setup, runtime, split, inputs, targets)
    agreed(runtime, run_model, TaskError)


def _first_keys(loader: DataLoader[Any]) -> list[int]:
    keys = []
    for key in loader.sampler:  # type: ignore[union-attr]
        keys.append(key)
        if len(keys) == loader.batch_size:
            break
    return keys


def _first_batch(setup: TrainingSetup, runtime: Runtime, split: str, loader: DataLoader[Any], keys: list[int]
                 ) -> tuple[Any, Any]:
    task, dataset = setup.task, loader.dataset
    assert isinstance(dataset, SeededItems)
    where = f"task {task.describe()}: the {split} dataset"
    items = call_task(task, f"the {split} dataset's __getitem__", lambda: dataset.__getitems__(keys))
    if setup.data.collate_fn is None:
        check_items(where, items, [dataset.index(key) for key in keys])
    batch = loader.collate_fn(items)
    if not (isinstance(batch, Sequence) and len(batch) == 2):
        raise TaskError(f"{where}: a batch must be (inputs, targets), got {type(batch).__name__}")
    return setup.inputs_on_device(batch[0]), to_device(batch[1], runtime.device)


def _check_model(setup: TrainingSetup, runtime: Runtime, split: str, inputs: Any, targets: Any) -> None:
    """The model, the loss and the metrics on one batch; ``split`` empty: a stand-in, run and not checked."""
    task = setup.task
    model = unwrap(setup.model)
    model.eval()
    try:
        with setup.autocast():
            outputs = call_task(task, f"the model's forward pass on the first {split} batch", lambda: model(inputs))
            if not split:
                return
            loss = call_task(task, f"loss() on the first {split} batch", lambda: setup.instance.loss(outputs, targets))
    finally:
        model.train()
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        found = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise TaskError(f"task {task.describe()}: loss() must return one number (a 0-dim tensor, the batch's mean), "
                        f"got {found}")
    if not loss.dtype.is_floating_point:
        raise TaskError(f"task {task.describe()}: loss() returned a {loss.dtype} tensor; it must be floating point")
    metrics = setup.metric_set()
    call_task(task, f"a metric's update() on the first {split} batch",
              lambda: metrics.update(loss.detach(), detached(outputs), targets))
    call_task(task, "a metric's compute()", lambda: metrics.compute(runtime, reduce=False))
    batch_size(targets)  # targets from which the number of samples can be told
