"""No launcher: one process, rank 0 of 1 (``python -m trainer``, ``ddp-train``, a notebook)."""

from __future__ import annotations

import os

from trainer.launchers.base import LaunchEnv, Launcher
from trainer.launchers.identity import DistIdentity


class SingleProcess(Launcher):
    name = "single-process"

    def detect(self, env: LaunchEnv) -> bool:
        return True  # the last in the order: whatever no other dialect claims

    def identity(self, env: LaunchEnv) -> DistIdentity:
        return self.place(env, 0, 0, 1, 1, 0, 1, ("127.0.0.1", 0))

    def job(self, env: LaunchEnv, master_addr: str, master_port: int) -> tuple[str, bool]:
        return f"process-{env.hostname}-{os.getpid()}", False
