"""A second user task, unlike the built-in and the example: token sequences classified by a bag of embeddings.

It exercises what a user's task may do and the trainer must carry exactly: inputs that are a dict of
tensors, targets that are Python ints, random augmentation with both NumPy and torch inside
``__getitem__`` (DataLoader workers included), dropout in the model, and a torchmetrics metric next to
one of the trainer's. Used as ``--task tests.support.tasks:TokenTask``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchmetrics
from torch import nn
from torch.utils.data import Dataset

from devtools.memory import PeakSampler
from trainer.metrics import Accuracy
from trainer.options import ResumeRule, option
from trainer.task import NoOptions, Task, TaskContext, TaskData

MASK = 0  # the token a masked position becomes


def counting_flops(outputs: torch.Tensor) -> bool:
    """Whether a loss() call is the trainer's FLOPs count (on meta tensors, once at the start on rank 0:
    docs/tasks.md), not a batch: the tasks below that count or time their loss calls skip it."""
    return outputs.is_meta


@dataclass
class TokenOptions:
    vocab: int = option(64, "tokens in the vocabulary", resume=ResumeRule.REFUSE)
    length: int = option(12, "tokens per sequence", resume=ResumeRule.REFUSE)
    classes: int = option(4, "classes", resume=ResumeRule.REFUSE)
    train_size: int = option(384, "training sequences", resume=ResumeRule.REFUSE)
    eval_size: int = option(96, "evaluation sequences", resume=ResumeRule.REFUSE)
    mask_prob: float = option(0.15, "share of tokens masked at random in each training item", resume=ResumeRule.FLAG)


class TokenSequences(Dataset[tuple[dict[str, torch.Tensor], int]]):
    """Each class has its own signal tokens; a sequence holds a few of its class's among random ones."""

    def __init__(self, options: TokenOptions, size: int, seed: int, augment: bool) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, options.classes, (size,), generator=generator)
        self.tokens = torch.randint(1, options.vocab, (size, options.length), generator=generator)
        signal = 1 + self.labels * 3  # tokens 1-3 for class 0, 4-6 for class 1, ...
        self.tokens[:, :3] = signal.view(-1, 1) + torch.arange(3)
        self.tokens = self.tokens[:, torch.randperm(options.length, generator=generator)]
        self.mask_prob = options.mask_prob if augment else 0.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], int]:
        tokens = self.tokens[index].clone()
        if self.mask_prob:
            masked = torch.from_numpy(np.random.random(len(tokens)) < self.mask_prob)  # NumPy's generator
            tokens[masked] = MASK
            tokens[torch.rand(len(tokens)) < self.mask_prob / 4] = int(torch.randint(1, 8, ()))  # torch's
        return {"tokens": tokens, "present": tokens != MASK}, int(self.labels[index])


class BagOfEmbeddings(nn.Module):
    def __init__(self, vocab: int, classes: int, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.dropout = nn.Dropout(0.2)
        self.head = nn.Linear(width, classes)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        present = batch["present"].unsqueeze(-1).float()
        pooled = (self.embed(batch["tokens"]) * present).sum(1) / present.sum(1).clamp_min(1)
        return self.head(self.dropout(pooled))


class TokenTask(Task[TokenOptions]):
    name = "tokens"
    Options = TokenOptions
    monitor, monitor_mode = "macro_f1", "max"

    def datasets(self, context: TaskContext) -> TaskData:
        train = TokenSequences(self.options, self.options.train_size, seed=11, augment=True)
        return TaskData(train, TokenSequences(self.options, self.options.eval_size, seed=12, augment=False))

    def model(self, data: TaskData) -> nn.Module:
        return BagOfEmbeddings(self.options.vocab, self.options.classes)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs.float(), targets, label_smoothing=0.05)

    def metrics(self) -> Mapping[str, Any]:
        return {"accuracy": Accuracy(),
                "macro_f1": torchmetrics.classification.MulticlassF1Score(self.options.classes, average="macro")}


class FlattensWithView(nn.Module):
    """A convolution whose output is flattened with ``.view()``: fine in the default layout, an error on a
    channels-last tensor (what --channels-last auto chooses for a conv model on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8 * 8, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.conv(images)
        return self.head(features.view(features.size(0), -1))


class Pictures(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randn(size, 1, 8, 8, generator=generator)
        self.labels = (self.images.mean((1, 2, 3)) > 0).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


class ViewTask(Task[NoOptions]):
    name = "view"

    def datasets(self, context: TaskContext) -> TaskData:
        return TaskData(Pictures(64, seed=1), Pictures(16, seed=2), deterministic_items=True)

    def model(self, data: TaskData) -> nn.Module:
        return FlattensWithView()

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs.float(), targets)


class WrongSizeTask(ViewTask):
    """Convolutions, then a Linear of the wrong width: the model fails in every memory layout (the first-batch
    check names the error)."""

    name = "wrong-size"

    def model(self, data: TaskData) -> nn.Module:
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(),
                             nn.Linear(7, 2))


class HangsTask(ViewTask):
    """Rank 1's main thread hangs in its sixth loss of a batch (the fifth training micro-batch): what a device
    synchronisation behind an NCCL kernel that never ends looks like from Python. No collective of its own
    times out there: only the progress watchdog can end it."""

    name = "hangs"
    calls = 0

    def model(self, data: TaskData) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 2))

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += not counting_flops(outputs)
        if os.environ.get("RANK") == "1" and self.calls == 6:
            time.sleep(3600)
        return super().loss(outputs, targets)


class RefusesDispatchOnRankOne(nn.Module):
    """Like a custom kernel that cannot run under a dispatch mode (the FLOPs counter's), on rank 1 only."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if os.environ.get("RANK") == "1" and _get_current_dispatch_mode() is not None:
            raise RuntimeError("this kernel has no implementation for a dispatch mode")
        return inputs


class CountFailsOnRankOneTask(ViewTask):
    """BatchNorm (synchronised by --sync-bn), then a layer the FLOPs counter cannot run on rank 1 alone: the
    count must not leave the ranks in different collectives."""

    name = "count-fails-on-rank-one"

    def model(self, data: TaskData) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8), RefusesDispatchOnRankOne(),
                             nn.Linear(8, 2))


@dataclass
class WideOptions:
    blocks: int = option(48, "Linear layers in the stack (each a sharding unit under --sync fsdp)")
    width: int = option(1024, "features in and out of each layer")
    memory_log: str = option("", "a folder where each rank records its resident memory (memory-RANK.json)")


class WideTask(Task[WideOptions]):
    """A stack of wide layers (48 x 1024 x 1024: 201 MB of float32 weights), for --meta-init: each rank records
    how much its memory grew at most (RssAnon, sampled every millisecond) between its datasets() and its first
    loss() of a batch (the model built, sharded and initialised, before any gradient exists; not the FLOPs count's
    call on meta tensors), against the model's size, and what it held before (a resume's checkpoint is read before
    datasets())."""

    name = "wide"
    Options = WideOptions

    def datasets(self, context: TaskContext) -> TaskData:
        self.rank = context.runtime.identity.rank
        self.sampler = PeakSampler() if self.options.memory_log else None
        generator = torch.Generator().manual_seed(context.seed)
        inputs = torch.randn(32, self.options.width, generator=generator)
        data = torch.utils.data.TensorDataset(inputs, inputs.flip(1))
        return TaskData(data, torch.utils.data.Subset(data, range(8)), deterministic_items=True, in_memory=True)

    def model(self, data: TaskData) -> nn.Module:
        return nn.Sequential(*(nn.Linear(self.options.width, self.options.width) for _ in range(self.options.blocks)))

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.sampler is not None and not counting_flops(outputs):
            import json

            before, grown, self.sampler = self.sampler.before, self.sampler.stop(), None
            full = 4 * self.options.blocks * (self.options.width + 1) * self.options.width
            with open(os.path.join(self.options.memory_log, f"memory-{self.rank}.json"), "w") as record:
                json.dump({"grown": grown, "full": full, "held_before": before}, record)
        return nn.functional.mse_loss(outputs.float(), targets)


class ScaledStack(nn.Module):
    """A Linear made first, then a parameter of its own (a plain build draws the Linear's weights first)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.scale, 1.0, 0.1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.fc(inputs) * self.scale


class InitWeightsTask(WideTask):
    """WideTask's data through ScaledStack blocks, with its own init_weights: every --sync (and --meta-init) must
    start it from the same weights."""

    name = "init-weights"

    def model(self, data: TaskData) -> nn.Module:
        return nn.Sequential(*(ScaledStack(self.options.width) for _ in range(self.options.blocks)))

    def init_weights(self, module: nn.Module) -> None:
        for name, tensor in module.named_parameters(recurse=False):
            if name == "scale":
                nn.init.normal_(tensor, 1.0, 0.02)
            else:
                nn.init.trunc_normal_(tensor, std=0.1)


@dataclass
class GateOptions:
    gate: str = option("", "a folder: at the gate's loss call, rank 0 writes 'reached' there and waits for 'go'")
    gate_at: int = option(5, "the loss call the gate stops at (the first is the first-batch check's)")


class GatedTask(ViewTask):
    """Stops at a known point of the training until the test says go: what the test does meanwhile (stop a
    server the run talks to) happens mid-run, every time."""

    name = "gated"
    Options = GateOptions
    calls = 0

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += not counting_flops(outputs)
        if self.options.gate and self.calls == self.options.gate_at and os.environ.get("RANK", "0") == "0":
            gate = Path(self.options.gate)
            (gate / "reached").touch()
            deadline = time.monotonic() + 120
            while not (gate / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().loss(outputs, targets)


@dataclass
class OutOfMemoryOptions:
    oom_at: int = option(5, "the loss call that runs out of device memory (the first two are the first-batch checks)")


class OutOfMemoryTask(ViewTask):
    """Runs out of memory in its loss: for real on CUDA (an allocation no GPU has), and on the CPU by raising the
    error CUDA's allocator raises, which no CPU allocation does."""

    name = "out-of-memory"
    Options = OutOfMemoryOptions
    calls = 0

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += not counting_flops(outputs)
        if self.calls == self.options.oom_at:
            if outputs.is_cuda:
                torch.empty(1 << 42, device=outputs.device)  # 16 TiB
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 TiB. GPU 0 has a total "
                                         "capacity of 0 bytes (raised by the test task on the CPU)")
        return super().loss(outputs, targets)


class Stage(nn.Module):
    """A convolution and a BatchNorm: one class, used at several widths and strides by StagesTask."""

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels_out)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(inputs)))


class StagesTask(ViewTask):
    """Blocks of one class at different shapes (each stage halves the image), as a ResNet's stages are: under
    --sync fsdp each is a unit, and torch.compile sees the block's forward once per shape."""

    def model(self, data: TaskData) -> nn.Module:
        return nn.Sequential(Stage(1, 4), Stage(4, 8, stride=2), Stage(8, 8, stride=2), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(8, 2))
