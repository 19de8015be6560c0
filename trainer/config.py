"""Typed configuration: one dataclass per concern, each field's help reused by the CLI.

Validation lives in ``__post_init__`` so that a config built from flags, from a
YAML file or from a checkpoint is checked the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trainer.errors import ConfigError

DATASETS = ("fashion-mnist", "mnist", "cifar10", "synthetic")
MODELS = ("convnet", "lenet", "resnet18", "resnet50")
SYNC_METHODS = ("ddp", "allreduce", "reduce-broadcast", "dp")
PRECISIONS = ("fp32", "bf16", "fp16")


def option(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field carrying its CLI help text (and allowed values)."""
    return field(default=default, metadata={"help": help, "choices": choices})


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass
class DataConfig:
    dataset: str = option("fashion-mnist", "dataset to train on", DATASETS)
    data_dir: str = option(
        "",
        "dataset folder or fsspec URL (s3://, memory://, file://); empty: the Debian package's "
        "Fashion-MNIST if installed, else the small subset shipped with the repository",
    )
    download: bool = option(False, "download the dataset into --data-dir if it is missing")
    data_cache_dir: str = option(
        "", "local cache for datasets fetched from a URL (default: ~/.cache/ddp-deploy/data)"
    )
    num_workers: int = option(0, "DataLoader worker processes per rank")
    max_train_samples: int = option(0, "use only the first N training samples (0: all)")
    max_test_samples: int = option(0, "use only the first N test samples (0: all)")
    synthetic_shape: str = option("1,28,28", "synthetic dataset: image shape C,H,W")
    synthetic_train_size: int = option(2048, "synthetic dataset: number of training samples")
    synthetic_test_size: int = option(512, "synthetic dataset: number of test samples")
    synthetic_classes: int = option(10, "synthetic dataset: number of classes")

    def __post_init__(self) -> None:
        _check(self.dataset in DATASETS, f"--dataset {self.dataset!r}: choose one of {', '.join(DATASETS)}")
        _check(self.num_workers >= 0, f"--num-workers must be >= 0, got {self.num_workers}")
        _check(self.max_train_samples >= 0, "--max-train-samples must be >= 0")
        _check(self.max_test_samples >= 0, "--max-test-samples must be >= 0")
        self.synthetic_image_shape()  # validates the string
        _check(self.synthetic_train_size > 0 and self.synthetic_test_size > 0, "synthetic sizes must be > 0")
        _check(self.synthetic_classes >= 2, "--synthetic-classes must be >= 2")

    def synthetic_image_shape(self) -> tuple[int, int, int]:
        try:
            c, h, w = (int(part) for part in self.synthetic_shape.split(","))
        except ValueError:
            raise ConfigError(
                f"--synthetic-shape {self.synthetic_shape!r}: expected three integers C,H,W such as 3,32,32"
            ) from None
        _check(min(c, h, w) > 0, f"--synthetic-shape {self.synthetic_shape!r}: sizes must be positive")
        return c, h, w


@dataclass
class ModelConfig:
    model: str = option("convnet", "model architecture", MODELS)
    sync_bn: bool = option(False, "synchronise BatchNorm statistics across ranks (works on gloo too)")
    compile: bool = option(False, "compile the model with torch.compile")

    def __post_init__(self) -> None:
        _check(self.model in MODELS, f"--model {self.model!r}: choose one of {', '.join(MODELS)}")


@dataclass
class OptimConfig:
    optimizer: str = option("adamw", "optimizer", ("adamw", "sgd"))
    lr: float = option(1e-3, "peak learning rate (before --scale-lr)")
    weight_decay: float = option(0.0, "weight decay")
    momentum: float = option(0.9, "SGD momentum")
    schedule: str = option("cosine", "learning-rate schedule after warm-up", ("constant", "cosine"))
    warmup_steps: int = option(0, "linear warm-up steps")
    scale_lr: bool = option(False, "multiply the learning rate by the world size (linear scaling rule)")
    grad_accum_steps: int = option(1, "micro-batches per optimizer step (gradients synchronised once)")
    clip_grad_norm: float = option(0.0, "clip the gradient norm to this value (0: off)")
    precision: str = option("fp32", "fp32, bf16 autocast (CPU and GPU) or fp16 with a grad scaler (GPU)",
                            PRECISIONS)

    def __post_init__(self) -> None:
        _check(self.optimizer in ("adamw", "sgd"), f"--optimizer {self.optimizer!r}: choose adamw or sgd")
        _check(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        _check(self.schedule in ("constant", "cosine"), f"--schedule {self.schedule!r}: constant or cosine")
        _check(self.warmup_steps >= 0, "--warmup-steps must be >= 0")
        _check(self.grad_accum_steps >= 1, f"--grad-accum-steps must be >= 1, got {self.grad_accum_steps}")
        _check(self.clip_grad_norm >= 0, "--clip-grad-norm must be >= 0")
        _check(self.precision in PRECISIONS, f"--precision {self.precision!r}: one of {', '.join(PRECISIONS)}")


@dataclass
class TrainConfig:
    epochs: int = option(3, "number of epochs")
    batch_size: int = option(128, "samples per rank per micro-batch")
    eval_batch_size: int = option(512, "samples per rank per evaluation batch")
    max_steps: int = option(0, "stop (with a checkpoint) once this many optimizer steps are done in total; "
                                "the LR schedule still spans --epochs (0: no limit)")
    seed: int = option(0, "random seed (same seed and world size: bitwise the same run on CPU)")
    sync: str = option("ddp", "gradient synchronisation method", SYNC_METHODS)

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}")
        _check(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        _check(self.eval_batch_size >= 1, "--eval-batch-size must be >= 1")
        _check(self.max_steps >= 0, "--max-steps must be >= 0")
        _check(self.sync in SYNC_METHODS, f"--sync {self.sync!r}: choose one of {', '.join(SYNC_METHODS)}")


@dataclass
class DistConfig:
    device: str = option("auto", "auto: cuda:LOCAL_RANK when CUDA is present, else cpu", ("auto", "cpu", "cuda"))
    backend: str = option("auto", "auto: nccl on CUDA, gloo on CPU", ("auto", "gloo", "nccl"))
    rendezvous_timeout_s: float = option(300.0, "how long to wait for the master address to accept connections")
    collective_timeout_s: float = option(600.0, "timeout of init_process_group and of each collective")
    threads_per_rank: int = option(0, "torch threads per rank on CPU (0: OMP_NUM_THREADS, else cores / local ranks)")

    def __post_init__(self) -> None:
        _check(self.device in ("auto", "cpu", "cuda"), f"--device {self.device!r}: auto, cpu or cuda")
        _check(self.backend in ("auto", "gloo", "nccl"), f"--backend {self.backend!r}: auto, gloo or nccl")
        _check(self.rendezvous_timeout_s > 0, "--rendezvous-timeout-s must be > 0")
        _check(self.collective_timeout_s > 0, "--collective-timeout-s must be > 0")
        _check(self.threads_per_rank >= 0, "--threads-per-rank must be >= 0")


@dataclass
class CheckpointConfig:
    checkpoint_dir: str = option("", "checkpoint folder or fsspec URL (default: OUTPUT_DIR/checkpoints)")
    checkpoint_every: int = option(0, "also save every N optimizer steps (0: only at the end of each epoch)")
    keep_last: int = option(3, "how many recent checkpoints to keep (>= 2)")
    keep_best: bool = option(False, "also keep the checkpoint with the best test accuracy")
    resume: str = option("latest", "latest (newest valid checkpoint, if any), none, or a checkpoint path")
    async_checkpoint: bool = option(False, "write checkpoints in a background thread")
    grace_period_s: float = option(25.0, "after SIGTERM, exit within this many seconds (checkpoint included)")

    def __post_init__(self) -> None:
        _check(self.checkpoint_every >= 0, "--checkpoint-every must be >= 0")
        _check(self.keep_last >= 2, f"--keep-last must be >= 2 (a crash during a save needs a fallback), "
                                    f"got {self.keep_last}")
        _check(bool(self.resume), "--resume must be latest, none or a path")
        _check(self.grace_period_s > 0, "--grace-period-s must be > 0")


@dataclass
class OutputConfig:
    output_dir: str = option("runs/default", "folder for metrics.jsonl, TensorBoard events, config and summary")
    log_every: int = option(20, "log a metrics line every N optimizer steps")
    progress: str = option("auto", "progress bar on rank 0: auto (when a terminal), on, off", ("auto", "on", "off"))
    tensorboard: bool = option(True, "write TensorBoard event files")
    sample_log: bool = option(False, "record every training sample index each rank consumes (audit of resume)")

    def __post_init__(self) -> None:
        _check(self.log_every >= 1, "--log-every must be >= 1")
        _check(self.progress in ("auto", "on", "off"), f"--progress {self.progress!r}: auto, on or off")


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "dist": DistConfig,
    "checkpoint": CheckpointConfig,
    "output": OutputConfig,
}


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def __post_init__(self) -> None:
        if self.optim.precision == "fp16" and self.dist.device == "cpu":
            raise ConfigError("--precision fp16 needs a GPU; use --precision bf16 on CPU")
        if self.train.sync == "dp" and self.model.sync_bn:
            raise ConfigError("--sync dp runs one process; --sync-bn needs several ranks (use --sync ddp)")

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.checkpoint_dir or f"{self.output.output_dir.rstrip('/')}/checkpoints"

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Config:
        """Build from nested ``{section: {field: value}}`` and/or flat ``{field: value}`` entries."""
        nested: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        owner = {f.name: section for section, kind in SECTIONS.items() for f in dataclasses.fields(kind)}
        for key, value in values.items():
            if key in SECTIONS and isinstance(value, dict):
                for inner_key, inner_value in value.items():
                    _place(nested, owner, inner_key, inner_value, expected_section=key)
            else:
                _place(nested, owner, key, value, expected_section=None)
        sections = {name: _build_section(SECTIONS[name], fields) for name, fields in nested.items()}
        return cls(**sections)


def _place(
    nested: dict[str, dict[str, Any]],
    owner: dict[str, str],
    key: str,
    value: Any,
    expected_section: str | None,
) -> None:
    name = key.replace("-", "_")
    section = owner.get(name)
    if section is None or (expected_section is not None and section != expected_section):
        known = ", ".join(sorted(owner))
        raise ConfigError(f"unknown config key {key!r}; known keys: {known}")
    nested[section][name] = value


def _build_section(kind: type, values: dict[str, Any]) -> Any:
    typed = {}
    for f in dataclasses.fields(kind):
        if f.name in values:
            typed[f.name] = _coerce(f.name, type(f.default), values[f.name])
    return kind(**typed)


def _coerce(name: str, expected: type, value: Any) -> Any:
    """Accept YAML's natural types, refuse what would silently mean something else."""
    if expected is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {name!r} must be true or false, got {value!r}")
    if expected is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if expected is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if expected is str and isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"config key {name!r} must be {expected.__name__}, got {value!r}")
