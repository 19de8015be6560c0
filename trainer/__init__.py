"""ddp-deploy: one data-parallel trainer for torchrun, TorchX, Docker Compose and Kubeflow."""

__version__ = "0.1.0"
