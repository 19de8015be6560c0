"""ddp-deploy: one data-parallel trainer for torchrun, TorchX, Docker Compose and Kubeflow.

The public API (docs/api.md) is what ``__all__`` lists here and in the modules named in
``PUBLIC_MODULES``; everything else may change without notice.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

PUBLIC_MODULES = (
    "trainer.api",
    "trainer.task",
    "trainer.metrics",
    "trainer.options",
    "trainer.registry",
    "trainer.config",
    "trainer.errors",
    "trainer.launchers",
    "trainer.distributed",
    "trainer.models",
    "trainer.data",
    "trainer.data.shards",
    "trainer.data.shards.writer",
    "trainer.gradsync",
    "trainer.sharding",
    "trainer.syncbn",
    "trainer.sampler",
    "trainer.build",
    "trainer.checkpoint",
    "trainer.tasks",
    "trainer.doctor",
    "trainer.export",
    "trainer.tracking",
    "trainer.on_ray",
)
__all__ = ["PUBLIC_MODULES", "Task", "TaskData", "__version__", "run"]


def __getattr__(name: str) -> Any:
    # Imported on first use: `import trainer` alone (the version, the list above) must not load torch.
    if name == "run":
        from trainer.api import run

        return run
    if name in ("Task", "TaskData"):
        from trainer import task

        return getattr(task, name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
