"""The doctor with one rank on a node whose NVIDIA driver is too old for CUDA to start, though a GPU is attached:
``python -m tests.workers.doctor_old_driver RANK FOLDER [flags]``. That rank's node is made up in FOLDER
(tests/support/nvidia_node.py); the others run on this machine's."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.support.nvidia_node import PROPRIETARY, fake_node
from trainer import cuda_driver
from trainer.doctor.cli import main
from trainer.launchers import identity_from_env


def main_on_old_driver(argv: list[str]) -> int:
    rank, folder = int(argv[0]), Path(argv[1])
    if identity_from_env(os.environ).rank == rank:
        cuda_driver.THIS_NODE = fake_node(folder, PROPRIETARY, gpus=1)
    return main(argv[2:])


if __name__ == "__main__":
    sys.exit(main_on_old_driver(sys.argv[1:]))
