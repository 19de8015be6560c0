"""Which backend each of the trainer's process groups runs: ``torchrun --nproc-per-node 2 -m
tests.workers.group_backends DEVICE`` joins the trainer's groups (trainer.distributed.init_process_group) with
every rank on DEVICE (``cuda``: all on GPU 0, which NCCL allows for creating the groups but not for running a
collective) and prints ``training BACKEND control BACKEND`` per rank. No collective is run on the training
group: two ranks on one GPU cannot run NCCL's."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from trainer.config import DistConfig
from trainer.distributed import choose_backend, destroy_process_group, init_process_group
from trainer.launchers import identity_from_env


def main(device_name: str) -> None:
    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    config = DistConfig(device=device_name)
    runtime = init_process_group(config, identity_from_env(os.environ), device)
    try:
        assert runtime.control is not None
        print(f"rank {runtime.identity.rank} training {dist.get_backend()} control {dist.get_backend(runtime.control)}"
              f" (chosen {choose_backend(config, device)})", flush=True)
    finally:
        if runtime.liveness is not None:
            runtime.liveness.close()
        destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
