"""A task: the workload the trainer carries. The user's model, data, loss and metrics, in one class.

Everything else (launchers, rendezvous, the global sample order, exact resume and resize, SyncBN,
precision, gradient accumulation, exact evaluation, checkpoints, preemption, metrics files) is the
trainer's and applies to every task alike::

    @dataclass
    class ForecastOptions:
        window: int = option(32, "input steps per sample", resume=ResumeRule.REFUSE)

    class Forecast(Task[ForecastOptions]):
        name = "forecast"                      # saved in checkpoints; another task's are refused
        Options = ForecastOptions              # become flags (--window) and YAML keys (task: {window: ...})

        def datasets(self, context):           # map-style datasets of (inputs, targets) items
            return TaskData(train=..., eval=...)

        def model(self, data):                 # data is what datasets() returned
            return ForecastNet(self.options.window)

        def loss(self, outputs, targets):      # outputs = model(inputs), under autocast
            return F.smooth_l1_loss(outputs.float(), targets)

        def metrics(self):                     # evaluated exactly across ranks (trainer.metrics)
            return {"mae": MeanAbsoluteError()}

Run it with ``ddp-train --task mypackage.module:Forecast --window 64`` under any launcher, or from a
script with ``trainer.run(Forecast)``. See docs/tasks.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import site
import sys
import sysconfig
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from trainer.distributed import Runtime
from trainer.errors import TaskError, UserError, described
from trainer.metrics import Metric
from trainer.options import as_dict
from trainer.registry import Registry

__all__ = ["NoOptions", "Task", "TaskContext", "TaskData", "batch_size", "to_device"]

OptionsT = TypeVar("OptionsT")
REQUIRED = ("name", "datasets", "model", "loss")  # what a task class must define; metrics and Options are optional


@dataclass
class NoOptions:
    """The options of a task that has none."""


@dataclass
class TaskData:
    """What a task's datasets() returns.

    ``train`` and ``eval`` are map-style datasets (``__len__`` and ``__getitem__``) of
    ``(inputs, targets)`` items; inputs and targets are tensors or nested lists, tuples or dicts of them.
    """

    train: Dataset[Any]
    eval: Dataset[Any]
    info: Any = None  # anything model() needs to know about the data (classes, shapes), passed back to it
    collate_fn: Callable[[Any], Any] | None = None  # how items become a batch (default: torch's default_collate)
    # Items are a function of their index alone (no random transform): the trainer need not seed each one.
    deterministic_items: bool = False
    # Items are slices of tensors already in memory: DataLoader workers would only add overhead.
    in_memory: bool = False
    # Applied to each batch's inputs once they are on the device, before the model: the part of preparing a
    # batch that is cheaper there (uint8 images normalised to float: a quarter of the bytes cross the bus, and
    # the GPU does in microseconds what the host's cores would spend milliseconds on). Same result on the CPU.
    on_device: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class TaskContext:
    """What datasets() may use: the group (for work done once per node, see trainer.distributed) and the seed."""

    runtime: Runtime
    seed: int


class Task(Generic[OptionsT]):
    """Base class of tasks (a class with the same attributes works too; this one adds the defaults)."""

    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    # The evaluation metric that --keep-best keeps the best checkpoint by, and whether higher is better.
    monitor: ClassVar[str] = "loss"
    monitor_mode: ClassVar[str] = "min"

    def __init__(self, options: OptionsT) -> None:
        self.options = options

    def datasets(self, context: TaskContext) -> TaskData:
        raise NotImplementedError

    def model(self, data: TaskData) -> nn.Module:
        raise NotImplementedError

    def loss(self, outputs: Any, targets: Any) -> Tensor:
        raise NotImplementedError

    def metrics(self) -> Mapping[str, Any]:
        """Evaluation metrics by name: trainer.metrics.Metric or torchmetrics.Metric objects, new ones per call."""
        return {}


@dataclass(frozen=True)
class TaskSpec:
    """A task class as resolved from --task, and how the user named it."""

    cls: type
    source: str  # "classification" or "mypackage.module:Forecast"

    @property
    def name(self) -> str:
        return str(self.cls.name)

    @property
    def options_type(self) -> type:
        return getattr(self.cls, "Options", NoOptions)

    @property
    def monitor(self) -> tuple[str, str]:
        """(the metric --keep-best keeps the best checkpoint by, "min" or "max")."""
        return getattr(self.cls, "monitor", "loss"), getattr(self.cls, "monitor_mode", "min")

    def describe(self) -> str:
        return self.name if self.source == self.name else f"{self.name!r} ({self.source})"

    def create(self, options: Any) -> Any:
        return call_task(self, f"creating it ({self.cls.__name__}(options))", lambda: self.cls(options))


@dataclass(frozen=True)
class RunTask:
    """What a run trains, carried from the CLI to the loop: the task class --task named, and its options.

    (The object the class makes with those options is the setup's ``instance``; what a checkpoint keeps of
    this is its ``task`` part, a trainer.checkpoint.TaskRecord.)"""

    spec: TaskSpec
    options: Any  # an instance of the task's Options dataclass

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def source(self) -> str:
        return self.spec.source

    @property
    def monitor(self) -> tuple[str, str]:
        return self.spec.monitor

    def describe(self) -> str:
        return self.spec.describe()

    def create(self) -> Any:
        return self.spec.create(self.options)

    def options_dict(self) -> dict[str, Any]:
        return as_dict(self.options) if dataclasses.is_dataclass(self.options) else {}

    def to_dict(self) -> dict[str, Any]:
        """The YAML layout: ``{name: <as --task named it>, <options>}``."""
        return {"name": self.source, **self.options_dict()}


def resolve(source: str | type, builtins: Registry[type]) -> TaskSpec:
    """The task class named by --task: a built-in's name or ``package.module:Name``; TaskError otherwise."""
    if isinstance(source, type):
        return _checked(TaskSpec(source, f"{source.__module__}:{source.__qualname__}"))
    if source in builtins:
        return _checked(TaskSpec(builtins.get(source), source))
    module_name, colon, attribute = source.partition(":")
    if not colon or not module_name or not attribute:
        raise TaskError(f"--task {source!r}: not a built-in task ({builtins.describe()}) and not an import path "
                        f"like mypackage.module:MyTask")
    module = _import(source, module_name)
    try:
        obj = getattr(module, attribute)
    except AttributeError:
        defined = sorted(name for name, value in vars(module).items()
                         if isinstance(value, type) and value.__module__ == module.__name__)
        raise TaskError(f"--task {source}: module {module_name} ({module.__file__}) has no {attribute!r}; it "
                        f"defines {', '.join(defined) or 'no classes'}") from None
    if not isinstance(obj, type):
        raise TaskError(f"--task {source}: {attribute} is a {type(obj).__name__}, not a class; name the task class "
                        f"(a subclass of trainer.task.Task)")
    return _checked(TaskSpec(obj, source))


def _import(source: str, module_name: str) -> Any:
    # The current directory too, as `python -m` has it and a console script (ddp-train) does not: a task
    # in the folder the command is run from is found the same way whatever started the trainer.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise TaskError(
                f"--task {source}: no module named {missing!r} in the current directory ({os.getcwd()}), on "
                f"PYTHONPATH ({os.environ.get('PYTHONPATH') or 'unset'}) or among the installed packages "
                f"({', '.join(site.getsitepackages())}); pip install your package into this environment (in a "
                f"container: an image FROM ddp-deploy that pip installs it), or put the folder that holds it on "
                f"PYTHONPATH"
            ) from None
        raise TaskError(f"--task {source}: importing {module_name} failed: {described(error)}{_where(error)}; "
                        f"install what it needs") from None
    except Exception as error:  # a syntax error or any failure in the module's own top-level code
        raise TaskError(f"--task {source}: importing {module_name} failed: {described(error)}{_where(error)}"
                        ) from None


def _checked(spec: TaskSpec) -> TaskSpec:
    cls = spec.cls
    missing = [part for part in REQUIRED if not hasattr(cls, part)
               or getattr(cls, part) is getattr(Task, part, None)]
    if missing:
        raise TaskError(f"--task {spec.source}: {cls.__name__} lacks {', '.join(missing)}; a task defines "
                        f"name, datasets(context), model(data) and loss(outputs, targets), and may define "
                        f"metrics() and Options (see docs/tasks.md)")
    if not isinstance(cls.name, str) or not cls.name:
        raise TaskError(f"--task {spec.source}: {cls.__name__}.name must be a non-empty string, the task's identity "
                        f"in checkpoints")
    options = spec.options_type
    if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise TaskError(f"--task {spec.source}: {cls.__name__}.Options must be a dataclass of option() fields, got "
                        f"{options!r}")
    unset = [field.name for field in dataclasses.fields(options)
             if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING]
    if unset:
        raise TaskError(f"--task {spec.source}: option {', '.join(unset)} of {cls.__name__}.Options has no default; "
                        f"give every option one")
    return spec


def call_task(spec: TaskSpec | RunTask, part: str, call: Callable[[], Any]) -> Any:
    """Run one part of a user's task; its failure becomes one line naming the task, the part and the place."""
    try:
        return call()
    except TaskError:
        raise
    except UserError:  # the task reports bad input itself, or a built-in's DataError
        raise
    except Exception as error:
        raise TaskError(f"task {spec.describe()}: {part} raised {described(error)}{_where(error)}") from None


def _where(error: BaseException) -> str:
    """`` (at file:line)`` of the innermost frame in code of the user's: not the trainer's, torch's or Python's."""
    if isinstance(error, SyntaxError) and error.filename:
        return f" (at {error.filename}:{error.lineno})"
    theirs = (_TRAINER_DIR, _TORCH_DIR, _STDLIB_DIR)
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not frame.filename.startswith(theirs) and "importlib" not in frame.filename:
            return f" (at {frame.filename}:{frame.lineno})"
    return ""


_TRAINER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep


def check_metrics(spec: TaskSpec | RunTask, metrics: Any) -> dict[str, Any]:
    """The task's metrics, each one that the trainer can reduce across ranks; TaskError otherwise."""
    if not isinstance(metrics, Mapping):
        raise TaskError(f"task {spec.describe()}: metrics() must return a dict of name -> metric, got "
                        f"{type(metrics).__name__}")
    checked = {}
    for name, metric in metrics.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise TaskError(f"task {spec.describe()}: metric name {name!r} must be a non-empty string without '/'")
        if name == "loss":
            raise TaskError(f"task {spec.describe()}: 'loss' is the trainer's own metric (the mean of loss()); "
                            f"name yours otherwise")
        if isinstance(metric, Metric):
            if not metric.state:
                raise TaskError(f"task {spec.describe()}: metric {name!r} ({type(metric).__name__}) declares no "
                                f"state with add_state(), so its value cannot be reduced across ranks")
        elif not _is_torchmetric(metric):
            raise TaskError(f"task {spec.describe()}: metric {name!r} is a {type(metric).__name__}, which cannot "
                            f"be reduced across ranks; use a trainer.metrics.Metric (states with a declared "
                            f"reduction) or a torchmetrics.Metric")
        checked[name] = metric
    return checked


def _is_torchmetric(metric: Any) -> bool:
    torchmetrics = sys.modules.get("torchmetrics")  # a torchmetrics metric was built, so the module is loaded
    return torchmetrics is not None and isinstance(metric, torchmetrics.Metric)


def batch_size(targets: Any) -> int:
    """Samples in a batch: the first dimension of the first tensor among the targets."""
    if isinstance(targets, Tensor):
        return int(targets.shape[0]) if targets.dim() else 1
    if isinstance(targets, Mapping):
        return batch_size(next(iter(targets.values())))
    if isinstance(targets, list | tuple) and targets:
        return batch_size(targets[0])
    raise TaskError(f"cannot tell the number of samples in a batch from targets of type {type(targets).__name__}; "
                    f"targets must be a tensor, or a list, tuple or dict of tensors")


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors of a nested batch moved to the device (non-blocking: pinned memory overlaps the copy)."""
    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=True))


def map_tensors(batch: Any, change: Callable[[Tensor], Tensor]) -> Any:
    """A nested batch (dicts, lists, tuples, namedtuples) with ``change`` applied to each tensor in it."""
    if isinstance(batch, Tensor):
        return change(batch)
    if isinstance(batch, Mapping):
        return {key: map_tensors(value, change) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(map_tensors(value, change) for value in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(map_tensors(value, change) for value in batch)
    return batch
