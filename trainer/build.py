"""Everything a run needs, built once from the config and the task: data, loaders, model, optimizer, schedule."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, Dataset, Subset

from trainer.checkpoint.parts import PartKind, RestoreContext, StatePart, StateParts
from trainer.checkpoint.shards import is_marker
from trainer.config import Config
from trainer.cores import usable_cores
from trainer.data.shards import ShardedDataset, ShardedItems
from trainer.data.shards.fetching import start_fetching
from trainer.data.shards.sampler import BlockSampler, OrderSettings, ShardedDistributedSampler
from trainer.distributed import Runtime, agreed
from trainer.errors import TaskError, described
from trainer.evaluation import MetricSet
from trainer.gpu import DeviceTuning, choose_tuning, set_tf32
from trainer.gradsync import GradSync, SyncOptions, build_grad_sync, unwrap
from trainer.items import checked_collate
from trainer.optimizer_state import by_index, by_name, index_to_name, parameter_names
from trainer.optimizers import build_optimizer
from trainer.preemption import ignore_stop_signals_in_worker
from trainer.rng import RngState, capture_rng, isolated, restore_rng, seed_after_resize, seed_everything
from trainer.sampler import EVAL_EPOCH, ResumableDistributedSampler, SeededItems, ShardSampler
from trainer.schedule import LRSchedule
from trainer.sharding import initialise_in_order, initialise_on_device, registration_order
from trainer.syncbn import convert_sync_batchnorm
from trainer.task import RunTask, TaskContext, TaskData, call_task, check_metrics, to_device
from trainer.throughput import NOT_COUNTED, Throughput, count_flops, device_peak

__all__ = ["evaluation_loader", "loader_workers", "state_parts", "training_loader"]

# JPEG decoding on the GPU machine (figure 2, an H100 with 16 cores, 2026-11-25): 4 workers fed ResNet-50 1,810
# images/s, under half of what it trains from memory (3,891); one per two cores of the rank's share, up to 8.
MAX_AUTO_WORKERS = 8
log = logging.getLogger("trainer")


@dataclass
class TrainingSetup:
    task: RunTask  # what this run trains: the task class and its options
    instance: Any  # the object the task class made with those options: its datasets, model, loss, metrics
    data: TaskData
    train_sampler: ResumableDistributedSampler
    train_loader: DataLoader[Any]
    eval_loader: DataLoader[Any]
    model: nn.Module  # what forward is called on (DDP-wrapped, compiled...)
    sync: GradSync
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    scaler: torch.amp.GradScaler
    precision: str
    device: torch.device
    tuning: DeviceTuning  # channels-last and cuDNN's autotuner (trainer.gpu)
    state: StateParts  # what a checkpoint saves of these; the loop adds where training stands
    throughput: Throughput  # FLOPs per sample and the device's peak: the log's FLOP/s and MFU (trainer.throughput)

    def inputs_on_device(self, batch: Any) -> Any:
        """A batch's inputs as the model takes them: on the device (non-blocking copies from pinned memory),
        prepared there by the task's ``on_device`` (trainer.task.TaskData), in the model's memory layout."""
        return inputs_on_device(batch, self.device, self.data.on_device, self.tuning)

    def autocast(self) -> AbstractContextManager[object]:
        return autocast_for(self.precision, self.device)

    def new_metrics(self) -> dict[str, Any]:
        """A fresh set of the task's metrics (one per training window set, one for evaluation)."""
        return check_metrics(self.task, call_task(self.task, "metrics()", self.instance.metrics))

    def metric_set(self) -> MetricSet:
        """The loss and the task's metrics, on the training device, ready to update."""
        return MetricSet(self.new_metrics(), self.device, owner=f"task {self.task.describe()}")


def inputs_on_device(batch: Any, device: torch.device, prepare: Callable[[Any], Any] | None,
                     tuning: DeviceTuning) -> Any:
    moved = to_device(batch, device)
    if prepare is not None:
        moved = prepare(moved)
    return tuning.inputs(moved)


def _loader(dataset: Dataset[Any], sampler: torch.utils.data.Sampler[int], batch_size: int, num_workers: int,
            seed: int, pin_memory: bool, collate_fn: Callable[[Any], Any]) -> DataLoader[Any]:
    # A generator of its own: otherwise every new iterator draws its base seed from the global RNG and
    # a resumed run, which starts iterating at a different time, would diverge from an uninterrupted one.
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      collate_fn=collate_fn, pin_memory=pin_memory, generator=generator,
                      persistent_workers=num_workers > 0,
                      worker_init_fn=ignore_stop_signals_in_worker if num_workers > 0 else None)


def training_loader(dataset: Dataset[Any], world_size: int, rank: int, batch_size: int, num_workers: int = 0,
                    seed: int = 0, deterministic_items: bool = False, collate_fn: Callable[[Any], Any] | None = None,
                    pin_memory: bool = False, where: str = "the training dataset",
                    shard_order: OrderSettings | None = None
                    ) -> tuple[DataLoader[Any], ResumableDistributedSampler]:
    """The trainer's training loader over a map-style dataset, and its sampler (``set_epoch`` before each
    epoch): one global order per epoch, resumable at any sample and world size, each item seeded. A sharded
    dataset gets the order that is local in shards (trainer.data.shards.sampler)."""
    if isinstance(dataset, ShardedDataset):
        sampler: ResumableDistributedSampler = ShardedDistributedSampler(
            dataset, world_size, rank, seed, batch_size, shard_order or OrderSettings(0, 1.0))
        items: SeededItems = ShardedItems(dataset, seed, deterministic_items)
    else:
        sampler = ResumableDistributedSampler(dataset, world_size, rank, seed, batch_size)
        items = SeededItems(dataset, seed, deterministic_items)
    loader = _loader(items, sampler, batch_size, num_workers, seed, pin_memory, checked_collate(collate_fn, where))
    return loader, sampler


def evaluation_loader(dataset: Dataset[Any], world_size: int, rank: int, batch_size: int, num_workers: int = 0,
                      seed: int = 0, deterministic_items: bool = False,
                      collate_fn: Callable[[Any], Any] | None = None, pin_memory: bool = False,
                      where: str = "the evaluation dataset") -> DataLoader[Any]:
    """The trainer's evaluation loader: this rank's shard, every sample on exactly one rank, no padding (of a sharded
    dataset, one contiguous block per rank)."""
    if isinstance(dataset, ShardedDataset):
        return _loader(ShardedItems(dataset, seed, deterministic_items, epoch_offset=EVAL_EPOCH),
                       BlockSampler(dataset, world_size, rank), batch_size, num_workers, seed, pin_memory,
                       checked_collate(collate_fn, where))
    return _loader(SeededItems(dataset, seed, deterministic_items, epoch_offset=EVAL_EPOCH),
                   ShardSampler(dataset, world_size, rank), batch_size, num_workers, seed, pin_memory,
                   checked_collate(collate_fn, where))


def loader_workers(setting: str, in_memory: bool, local_world_size: int) -> int:
    """--num-workers: a number, or auto: none for data in memory, else one per two cores of this rank's share
    (its container's CPU limit counted: trainer.cores)."""
    if setting != "auto":
        return int(setting)
    if in_memory:
        return 0
    return max(1, min(MAX_AUTO_WORKERS, usable_cores() // max(1, local_world_size) // 2))


def first(dataset: Dataset[Any], count: int) -> Dataset[Any]:
    """The first count items (all if fewer or count is 0), keeping a batched __getitems__ if there is one."""
    size = len(dataset)  # type: ignore[arg-type]
    if not count or count >= size:
        return dataset
    head = getattr(dataset, "head", None)
    return head(count) if callable(head) else Subset(dataset, range(count))


def build_training(config: Config, task: RunTask, runtime: Runtime,
                   trained_channels_last: bool | None = None) -> TrainingSetup:
    """``trained_channels_last``: the memory layout of the checkpoint this run resumes (None: a fresh start)."""
    identity, device, seed = runtime.identity, runtime.device, config.train.seed
    # Before the datasets: a --global-batch-size this world size does not divide fails at once.
    batch = config.train.per_rank_batch(identity.world_size, config.optim.grad_accum_steps)
    instance = agreed(runtime, task.create, TaskError)
    data = agreed(runtime, lambda: _task_data(task, instance, TaskContext(runtime, seed)), TaskError,
                  long_work="the task's datasets")
    train_set = first(data.train, config.data.max_train_samples)
    eval_set = first(data.eval, config.data.max_test_samples)

    workers = loader_workers(config.data.num_workers, data.in_memory, identity.local_world_size)
    if identity.is_main:
        log.info("data: %d training and %d evaluation samples; %d DataLoader worker(s) per rank (--num-workers %s)",
                 len(train_set), len(eval_set), workers, config.data.num_workers)  # type: ignore[arg-type]
    pin, where = device.type == "cuda", f"task {task.describe()}: the"
    if config.train.global_batch_size and identity.is_main:
        log.info("--global-batch-size %d: %d sample(s) per rank per micro-batch at %d rank(s) (--batch-size is not "
                 "used)", config.train.global_batch_size, batch, identity.world_size)
    train_loader, train_sampler = training_loader(
        train_set, identity.world_size, identity.rank, batch, workers, seed,
        data.deterministic_items, data.collate_fn, pin, f"{where} training dataset",
        OrderSettings(config.data.shard_lanes, config.data.shard_window))
    eval_loader = evaluation_loader(eval_set, identity.world_size, identity.rank, config.train.eval_batch_size,
                                    workers, seed, data.deterministic_items, data.collate_fn, pin,
                                    f"{where} evaluation dataset")
    start_fetching(config.data, runtime, train_loader, eval_loader)

    # The same seed on every rank gives every rank the same initial weights; then each rank's own
    # stream for anything random during training (dropout).
    seed_everything(seed)
    owner = f"task {task.describe()}"
    sync = build_grad_sync(config.train.sync, runtime, SyncOptions(
        config.optim.precision, getattr(instance, "shard_units", None), owner))
    init_weights = getattr(instance, "init_weights", None)  # optional in the task protocol (docs/tasks.md)
    meta = sync.sharded and (config.model.meta_init == "on" or (config.model.meta_init == "auto"
                                                                and init_weights is not None))
    with registration_order() as order:  # the order a plain build draws its weights in (trainer.sharding)
        model = agreed(runtime, lambda: _task_model(task, instance, data, meta), TaskError)
    if init_weights is not None and not meta:
        # The task's own initialisation, as --meta-init applies it: every --sync starts from the same weights.
        with isolated():
            seed_everything(seed)
            agreed(runtime, lambda: initialise_in_order(model, init_weights, order), TaskError)
    if config.model.sync_bn and identity.world_size > 1:
        model = convert_sync_batchnorm(model, device)
        layers = sum(isinstance(module, _BatchNorm) for module in model.modules())
        if identity.is_main:
            log.info("--sync-bn: %d BatchNorm layer(s) of the model synchronised across %d ranks", layers,
                     identity.world_size)
    if not meta:
        model = model.to(device)
    tuning = choose_tuning(config.model.channels_last, config.model.cudnn_benchmark, device, model,
                           trained_channels_last, sharded=sync.sharded)
    if (trained_channels_last is not None and not sync.sharded and tuning.channels_last != trained_channels_last
            and identity.is_main):
        log.warning("--channels-last %s: the checkpoint was trained channels-last %s and this run trains %s; the "
                    "convolutions' results change in their last bits, so training goes on correctly but not "
                    "bitwise like an uninterrupted run (--channels-last auto keeps the checkpoint's layout)",
                    config.model.channels_last, "on" if trained_channels_last else "off",
                    "on" if tuning.channels_last else "off")
    model = tuning.apply(model)
    if tuning.channels_last and not meta:  # a model without weights cannot try a forward pass
        tuning = agreed(runtime, lambda: _layout_that_runs(config, task, model, tuning, train_loader, device,
                                                           data.on_device), TaskError)
    if device.type == "cuda":
        tf32 = set_tf32(config.optim.precision)
        if identity.is_main:
            log.info("GPU settings: %s, %s", tuning.describe(), tf32)
    seed_everything(seed + identity.rank)

    # Rank 0 alone counts and reports the FLOPs (the same on every rank): no other rank waits on its count.
    throughput = (_throughput(config, runtime, instance, model, train_loader, batch, data, tuning, sync)
                  if identity.is_main else NOT_COUNTED)
    wrapped = agreed(runtime, lambda: sync.wrap(model), TaskError)
    if meta:
        with isolated():  # the weights a plain build draws right after seed_everything(seed)
            seed_everything(seed)
            held = agreed(runtime, lambda: initialise_on_device(model, device, init_weights, owner, order),
                          TaskError)
        if identity.is_main:
            log.info("--meta-init: model built on the meta device; rank 0 allocated %.1f MB of its shards", held / 1e6)
    if sync.sharded and identity.is_main:
        log.info("--sync %s: %s", config.train.sync, sync.describe())
    if config.model.compile:
        # Under --sync fsdp/hsdp each sharding unit's hooks end a graph, so blocks of one class (a ResNet's) are
        # compiled one shape at a time; the second shape would make dynamo compile them for dynamic shapes, which
        # inductor's CPU backend fails on for a bf16 BatchNorm's backward (torch 2.14: "Cannot convert expression
        # to float"). Compiled for their own shapes instead (ResNet-50: 8 graphs, the recompile limit's 8).
        wrapped = torch.compile(wrapped, dynamic=False) if sync.sharded else torch.compile(wrapped)

    base_lr = config.optim.lr * (identity.world_size if config.optim.scale_lr else 1)
    optimizer = build_optimizer(config.optim, model.parameters(), base_lr)
    global_batch = train_sampler.batch_size * identity.world_size * config.optim.grad_accum_steps
    # The schedule spans all epochs even with --max-steps: a job split into --max-steps segments
    # follows the same schedule as one that runs straight through.
    total_samples = config.train.epochs * len(train_set)  # type: ignore[arg-type]
    schedule = LRSchedule(config.optim.schedule, base_lr, config.optim.warmup_steps * global_batch, total_samples)
    scaler = torch.amp.GradScaler(device.type, enabled=config.optim.precision == "fp16")
    setup = TrainingSetup(task, instance, data, train_sampler, train_loader, eval_loader, wrapped, sync, optimizer,
                          schedule, scaler, config.optim.precision, device, tuning,
                          state_parts(unwrap(wrapped), optimizer, scaler), throughput)
    if isinstance(train_sampler, ShardedDistributedSampler):
        setup.state.add(shard_order_part(train_sampler))
    # A metric that cannot be reduced, or a monitored one that does not exist, fails now, not at evaluation.
    agreed(runtime, lambda: _check_monitor(task, setup.new_metrics()), TaskError)
    return setup


def state_parts(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> StateParts:
    """The checkpoint's parts of what is built here: the model (unwrapped from DDP and compile), the optimizer
    (by parameter name: trainer.optimizer_state), the grad scaler and the random generators."""
    parameters = frozenset(f"/{name}" for name, _ in model.named_parameters())
    names = parameter_names(model, optimizer)
    parts = StateParts()

    # Templates: a sharded run's tensors are fitted to this run's shards, whatever world size (or a plain run)
    # saved them (trainer.checkpoint.shards); an unsharded one's pass through unchanged.
    def restore_model(saved: dict[str, Any], _: RestoreContext) -> None:
        model.load_state_dict(saved)

    def restore_optimizer(saved: dict[str, Any], _: RestoreContext) -> None:
        optimizer.load_state_dict(by_index(saved, optimizer, names))

    # Only the optimizer step changes the parameters (buffers such as BatchNorm's statistics change in the
    # forward pass) and the optimizer's state: an asynchronous save copies those during the next step.
    parts.add(StatePart("model", model.state_dict, restore_model, opaque=True,
                        changed_by_step_only=parameters.__contains__, template=lambda _: model.state_dict()))
    # Version 2: keyed by parameter name (version 1: by index in the optimizer, this run's order).
    parts.add(StatePart("optimizer", lambda: by_name(optimizer.state_dict(), names), restore_optimizer,
                        opaque=True, changed_by_step_only=lambda path: path.startswith("/state/"), version=2,
                        upgrade=lambda _, saved: index_to_name(saved, names), oldest=1,
                        template=lambda saved: _optimizer_template(saved, model)))
    parts.add(StatePart("grad_scaler", scaler.state_dict, lambda saved, _: scaler.load_state_dict(saved),
                        opaque=True))
    parts.add(rng_part())
    return parts


def _optimizer_template(saved: Any, model: nn.Module) -> dict[str, Any]:
    """Where this run holds each saved optimizer tensor: a per-parameter state tensor of its parameter's shape
    (Adam's moments, SGD's momentum) is laid out, and sharded, like that parameter."""
    parameters = dict(model.named_parameters())
    state = saved.get("state") if isinstance(saved, dict) else None
    if not isinstance(state, dict):
        return {}

    def shaped_like(value: Any, parameter: torch.Tensor) -> bool:
        shape = value["shape"] if is_marker(value) else getattr(value, "shape", None)
        return shape is not None and list(shape) == list(parameter.shape)

    return {"state": {name: {key: parameters[name] for key, value in entry.items()
                             if shaped_like(value, parameters[name])}
                      for name, entry in state.items() if name in parameters and isinstance(entry, dict)}}


def shard_order_part(sampler: ShardedDistributedSampler) -> StatePart:
    """The epoch in progress's order over a sharded dataset (its lanes and window), so that a resume at any world size
    continues it; a checkpoint without the part (version 0) lets the epoch take this run's."""
    return StatePart("shard_order", sampler.order_state, lambda saved, _: sampler.restore_order_state(saved),
                     version=1, upgrade=lambda _, __: None)


def rng_part() -> StatePart:
    """Each rank's generators in a checkpoint; a resume at another world size seeds afresh (seed_after_resize)."""
    def restore(saved: list[RngState], context: RestoreContext) -> None:
        if context.saved_world_size == context.world_size:
            restore_rng(saved[context.rank])
        else:
            seed_after_resize(context.seed, context.step, context.rank)

    return StatePart("rng", capture_rng, restore, PartKind.PER_RANK)


def autocast_for(precision: str, device: torch.device) -> AbstractContextManager[object]:
    if precision in ("fp32", "tf32"):  # tf32: float32 tensors, some of whose CUDA kernels use TF32 (trainer.gpu)
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _layout_that_runs(config: Config, task: RunTask, model: nn.Module, tuning: DeviceTuning,
                      loader: DataLoader[Any], device: torch.device, prepare: Callable[[Any], Any] | None
                      ) -> DeviceTuning:
    """Channels-last, unless the model cannot run in it: a forward pass that flattens a convolution's output
    with ``.view()`` fails on a channels-last tensor (``.reshape()`` or ``flatten`` would not). Tried now, on
    one training sample (evaluation mode, no gradients, the random generators restored), before anything is
    trained: under ``auto`` the run falls back to the default layout with a warning, under ``on`` it stops with
    one line. A model that fails in both layouts is left to the first-batch check, which names its error."""
    failure = _forward_fails(config, model, tuning, loader, device, prepare)
    if failure is None:
        return tuning
    plain = DeviceTuning(channels_last=False, cudnn_benchmark=tuning.cudnn_benchmark)
    model.to(memory_format=torch.contiguous_format)
    if _forward_fails(config, model, plain, loader, device, prepare) is not None:
        tuning.apply(model)  # back to the chosen layout (the weights stay contiguous under a sharded --sync)
        return tuning
    reason = f"the model's forward pass fails in channels-last memory layout ({described(failure)})"
    if config.model.channels_last == "on":
        raise TaskError(f"task {task.describe()}: --channels-last on: {reason}; pass --channels-last off (or make "
                        f"the model use .reshape() or torch.flatten where it calls .view())")
    log.warning("task %s: %s; training in the default layout instead (--channels-last off skips this check; "
                ".reshape() or torch.flatten instead of .view() would let it use channels-last)", task.describe(),
                reason)
    return plain


def _forward_fails(config: Config, model: nn.Module, tuning: DeviceTuning, loader: DataLoader[Any],
                   device: torch.device, prepare: Callable[[Any], Any] | None) -> Exception | None:
    dataset = loader.dataset
    assert isinstance(dataset, SeededItems)
    try:
        with isolated(), torch.no_grad():
            batch = loader.collate_fn(dataset.__getitems__([dataset.probe_key()]))
            inputs = inputs_on_device(batch[0], device, prepare, tuning)
    except Exception:  # noqa: BLE001 - a broken dataset is the first-batch check's to report, with its index
        return None
    model.eval()
    try:
        with isolated(), torch.no_grad(), autocast_for(config.optim.precision, device):
            model(inputs)
    except Exception as error:  # noqa: BLE001 - any failure: the other layout decides what it means
        return error
    finally:
        model.train()
    return None


def _throughput(config: Config, runtime: Runtime, instance: Any, model: nn.Module, loader: DataLoader[Any], batch: int,
                data: TaskData, tuning: DeviceTuning, sync: GradSync) -> Throughput:
    """The model's FLOPs per sample, counted on a meta-device copy of it before the sync wraps it (a sharded
    model's count is of its whole module). On a batch of the run's size made of the training set's first sample
    (the one key every dataset, sharded ones too, can give before training: FLOPs depend on shapes only), prepared
    on the device as training prepares it, then moved to the meta device."""
    device, precision = runtime.device, config.optim.precision

    def first_sample_batch() -> tuple[Any, Any]:
        dataset = loader.dataset
        assert isinstance(dataset, SeededItems)
        inputs, targets = loader.collate_fn(dataset.__getitems__([dataset.probe_key()] * batch))
        return inputs_on_device(inputs, device, data.on_device, tuning), to_device(targets, device)

    flops = count_flops(model, first_sample_batch, instance.loss, lambda: autocast_for(precision, device))
    peak = device_peak(device, precision, config.output.peak_tflops)
    log.info("throughput: %s; %s", flops.said, peak.said)
    gpus = torch.cuda.device_count() if sync.one_process and device.type == "cuda" else 1  # --sync dp's
    return Throughput(flops.flops_per_sample, peak, runtime.identity.world_size * max(1, gpus))


def _check_monitor(task: RunTask, metrics: dict[str, Any]) -> None:
    monitor, mode = task.monitor
    if monitor not in ("loss", *metrics):
        raise TaskError(f"task {task.describe()}: monitor {monitor!r} is not one of its metrics "
                        f"({', '.join(['loss', *metrics])}); --keep-best keeps the best checkpoint by it")
    if mode not in ("min", "max"):
        raise TaskError(f"task {task.describe()}: monitor_mode must be 'min' or 'max', got {mode!r}")


def _task_data(task: RunTask, instance: Any, context: TaskContext) -> TaskData:
    data = call_task(task, "datasets()", lambda: instance.datasets(context))
    if not isinstance(data, TaskData):
        raise TaskError(f"task {task.describe()}: datasets() returned a {type(data).__name__}; return a "
                        f"trainer.task.TaskData(train=..., eval=...)")
    for split in ("train", "eval"):
        dataset = getattr(data, split)
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TaskError(f"task {task.describe()}: the {split} dataset ({type(dataset).__name__}) is not map-style: "
                            f"it needs __len__ and __getitem__ (an IterableDataset cannot be resumed exactly; stream "
                            f"shards with trainer.data.shards.ShardedDataset: docs/data.md)")
        size = call_task(task, f"len() of the {split} dataset", lambda dataset=dataset: len(dataset))
        if size == 0:
            raise TaskError(f"task {task.describe()}: the {split} dataset is empty")
    return data


def _task_model(task: RunTask, instance: Any, data: TaskData, meta: bool = False) -> nn.Module:
    """The task's model; on the meta device (no memory behind its tensors) for --meta-init."""
    with torch.device("meta") if meta else nullcontext():
        model = call_task(task, "model()", lambda: instance.model(data))
    if not isinstance(model, nn.Module):
        raise TaskError(f"task {task.describe()}: model() returned a {type(model).__name__}, not a torch.nn.Module")
    if not any(parameter.requires_grad for parameter in model.parameters()):
        raise TaskError(f"task {task.describe()}: model() returned a module with no trainable parameters")
    return model
