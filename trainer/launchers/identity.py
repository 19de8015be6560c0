"""Who this process is in its group, as every launcher dialect reports it: one typed value."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["DistIdentity"]


@dataclass(frozen=True)
class DistIdentity:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    launcher: str  # the dialect's name, for people: logs, the summary, the doctor's table
    hostname: str
    restart_count: int = 0  # which attempt this is: torchrun's TORCHELASTIC_RESTART_COUNT, SLURM_RESTART_COUNT
    agent_store: bool = False  # torchrun's agent already serves the store at MASTER_ADDR:MASTER_PORT
    # What a restart of this job has in common with this attempt, and a concurrent other job cannot have
    # (see trainer.launchers.base.Launcher.job): the checkpoint folder's lease lets "the same job" in at once.
    job: str = ""
    # False where no launcher names the job (a lone process, ranks started by hand on one host, torchrun's
    # static rendezvous on a loopback address): ``job`` is then this attempt's alone, and --job-id names it.
    job_named: bool = True
    # The launcher may show each process only its own GPU, as device 0 (srun --gpus-per-task=1).
    may_hide_other_gpus: bool = False
    # How many more times the launcher itself starts this job's workers again after a failure (torchrun's
    # --max-restarts less TORCHELASTIC_RESTART_COUNT); None where it never does, or where torchrun was given no
    # --max-restarts. torchrun also restarts them, without counting, when an elastic job's membership changes,
    # even with --max-restarts 0; but a worker cannot tell an elastic job from another, so there the lease is
    # released as for any job (docs/elastic.md asks elastic jobs for --max-restarts above 0). A stop before the
    # end keeps the checkpoint folder's lease for the next attempt (CheckpointManager.release_lease).
    restarts_left: int | None = None

    @property
    def is_main(self) -> bool:
        """The one process that writes checkpoints, metrics and the progress bar."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """The one process per node that downloads or fetches data."""
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size}, "
            f"node {self.node_rank}/{self.num_nodes}) on {self.hostname} via {self.launcher}, "
            f"master {self.master_addr}:{self.master_port}"
        )

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
