"""Everything a run needs, built once from the config: data, loaders, model, optimizer, schedule."""

from __future__ import annotations

import random
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainer.config import Config
from trainer.data import DatasetInfo, collate_batch, load_datasets
from trainer.distributed import Runtime
from trainer.gradsync import GradSync, build_grad_sync
from trainer.models import build_model
from trainer.preemption import ignore_stop_signals_in_worker
from trainer.sampler import ResumableDistributedSampler, ShardSampler
from trainer.schedule import LRSchedule
from trainer.syncbn import convert_sync_batchnorm


@dataclass
class TrainingSetup:
    info: DatasetInfo
    train_sampler: ResumableDistributedSampler
    train_loader: DataLoader
    test_loader: DataLoader
    model: nn.Module  # what forward is called on (DDP-wrapped, compiled...)
    sync: GradSync
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    scaler: torch.amp.GradScaler
    precision: str

    def autocast(self, device: torch.device) -> AbstractContextManager[object]:
        if self.precision == "fp32":
            return nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_loader(dataset: Dataset, sampler: torch.utils.data.Sampler[int], batch_size: int, num_workers: int,
                 seed: int, pin_memory: bool) -> DataLoader:
    # A generator of its own: otherwise every new iterator draws its base seed from the global RNG and
    # a resumed run, which starts iterating at a different time, would diverge from an uninterrupted one.
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      collate_fn=collate_batch, pin_memory=pin_memory, generator=generator,
                      persistent_workers=num_workers > 0,
                      worker_init_fn=ignore_stop_signals_in_worker if num_workers > 0 else None)


def build_training(config: Config, runtime: Runtime) -> TrainingSetup:
    identity, device = runtime.identity, runtime.device
    train_set, test_set, info = load_datasets(config.data, runtime)

    train_sampler = ResumableDistributedSampler(train_set, identity.world_size, identity.rank, config.train.seed)
    pin = device.type == "cuda"
    train_loader = build_loader(train_set, train_sampler, config.train.batch_size, config.data.num_workers,
                                config.train.seed, pin)
    test_loader = build_loader(test_set, ShardSampler(test_set, identity.world_size, identity.rank),
                               config.train.eval_batch_size, config.data.num_workers, config.train.seed, pin)

    # The same seed on every rank gives every rank the same initial weights; then each rank's own
    # stream for anything random during training (dropout, augmentation).
    seed_everything(config.train.seed)
    model = build_model(config.model.model, info.in_channels, info.image_size, info.num_classes)
    if config.model.sync_bn and identity.world_size > 1:
        model = convert_sync_batchnorm(model, device)
    model = model.to(device)
    seed_everything(config.train.seed + identity.rank)

    sync = build_grad_sync(config.train.sync, runtime)
    wrapped = sync.wrap(model)
    if config.model.compile:
        wrapped = torch.compile(wrapped)

    base_lr = config.optim.lr * (identity.world_size if config.optim.scale_lr else 1)
    if config.optim.optimizer == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=base_lr,
                                                             weight_decay=config.optim.weight_decay)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=config.optim.momentum,
                                    weight_decay=config.optim.weight_decay)

    global_batch = config.train.batch_size * identity.world_size * config.optim.grad_accum_steps
    # The schedule spans all epochs even with --max-steps: a job split into --max-steps segments
    # follows the same schedule as one that runs straight through.
    total_samples = config.train.epochs * len(train_set)
    schedule = LRSchedule(config.optim.schedule, base_lr, config.optim.warmup_steps * global_batch, total_samples)
    scaler = torch.amp.GradScaler(device.type, enabled=config.optim.precision == "fp16")
    return TrainingSetup(info, train_sampler, train_loader, test_loader, wrapped, sync, optimizer, schedule,
                         scaler, config.optim.precision)
