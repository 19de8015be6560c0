"""Preflight for a new cluster: who each rank is, whether every collective is right, how fast all-reduce is.

Run it first, under the launcher the trainer will use (flags as for the trainer's distributed section):

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m trainer.doctor
    RANK=0 WORLD_SIZE=2 MASTER_ADDR=host MASTER_PORT=29500 ddp-doctor      # Compose, PyTorchJob
    python -m trainer.doctor                                                 # one process

Each rank prints who it is before it joins the group, so a rendezvous that never completes shows who
arrived. Every rank then runs every check (checks.py) with values chosen so that a value from the
wrong rank, the wrong slot or the wrong operation shows, and times all-reduce (bandwidth.py); rank 0
prints the results and the bandwidth table (report.py). Exit status: 0 every check passed; 1 a check
failed (the message names the rank and the operation); 2 bad flags or launcher environment; 3 the
master was not reachable.
"""

from trainer.doctor.cli import DoctorConfig, main

__all__ = ["DoctorConfig", "main"]
