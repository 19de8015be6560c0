"""Typed configuration: one dataclass per concern of the trainer, plus the task's own options.

Every field is an ``option()`` (trainer.options): its help becomes the flag's, its choices come from
the seam's registry, and its resume rule says what a resume does when the value changed. Validation
lives in ``__post_init__``, so a config built from flags, YAML or a checkpoint is checked the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainer.errors import ConfigError
from trainer.options import ResumeRule, as_dict, check, check_choice, option
from trainer.schedule import SCHEDULES
from trainer.seams import OPTIMIZERS, SYNC_METHODS, TRACKERS

__all__ = ["SECTIONS", "CheckpointConfig", "Config", "DataConfig", "DistConfig", "ModelConfig", "OptimConfig",
           "OutputConfig", "TrackingConfig", "TrainConfig"]

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
DEFAULT_TASK = "classification"
FLAG, REFUSE = ResumeRule.FLAG, ResumeRule.REFUSE


@dataclass
class DataConfig:
    num_workers: str = option(
        "auto", "DataLoader worker processes per rank; auto: none for a task whose data is in memory, else "
        "one per two cores of the rank's share (at most 8)")
    max_train_samples: int = option(0, "use only the first N training samples (0: all)", resume=FLAG)
    max_test_samples: int = option(0, "use only the first N evaluation samples (0: all)")
    shard_cache_dir: str = option("", "sharded datasets: the node-local folder for the pieces of shards being read "
                                      "(default: ~/.cache/ddp-deploy/data/shards)")
    shard_cache_gb: float = option(8.0, "sharded datasets: the most the node's ranks together hold in that folder; "
                                        "pieces are fetched ahead within it and deleted once read")
    shard_lanes: int = option(0, "sharded datasets: parts of the stream read side by side (0: auto, the smallest "
                                 "multiple of the world size >= 12); each rank reads lanes/world-size of them, "
                                 "each shard's samples on one rank where the world size divides the lanes")
    shard_window: float = option(1.0, "sharded datasets: samples shuffled together within a lane, in shards' worth; "
                                      "more mixes further and holds more in the cache")
    shard_retries: int = option(6, "sharded datasets: attempts per request to the store before the run ends to "
                                   "be restarted (exit 200); a missing or unreadable shard ends it at once (exit 2)")

    def __post_init__(self) -> None:
        check(self.num_workers == "auto" or (self.num_workers.isdigit()),
              f"--num-workers {self.num_workers!r}: auto or a number >= 0")
        check(self.shard_cache_gb > 0, f"--shard-cache-gb must be > 0, got {self.shard_cache_gb}")
        check(0 <= self.shard_lanes < 4096, f"--shard-lanes must be in 0..4095 (0: auto), got {self.shard_lanes}")
        check(self.shard_window > 0, f"--shard-window must be > 0, got {self.shard_window}")
        check(self.shard_retries >= 1, f"--shard-retries must be >= 1, got {self.shard_retries}")
        check(self.max_train_samples >= 0, "--max-train-samples must be >= 0")
        check(self.max_test_samples >= 0, "--max-test-samples must be >= 0")


@dataclass
class ModelConfig:
    sync_bn: bool = option(False, "synchronise BatchNorm statistics across ranks (works on gloo too)", resume=FLAG)
    compile: bool = option(False, "compile the model with torch.compile")
    channels_last: str = option("auto", "NHWC memory layout for the model and 4-D inputs: auto (on CUDA, for a "
                                        "model with 2-D convolutions), on, off", ("auto", "on", "off"))
    cudnn_benchmark: str = option("auto", "cuDNN's autotuner (torch.backends.cudnn.benchmark): auto (on with CUDA), "
                                          "on, off (for bitwise repeatable GPU runs)", ("auto", "on", "off"))
    meta_init: str = option("auto", "with --sync fsdp/hsdp, build the model on the meta device and allocate only "
                                    "this rank's shards: auto (when the task has init_weights), on, off",
                            ("auto", "on", "off"))

    def __post_init__(self) -> None:
        check_choice(self.channels_last, "channels_last", ("auto", "on", "off"))
        check_choice(self.cudnn_benchmark, "cudnn_benchmark", ("auto", "on", "off"))
        check_choice(self.meta_init, "meta_init", ("auto", "on", "off"))


@dataclass
class OptimConfig:
    optimizer: str = option("adamw", "optimizer", OPTIMIZERS, resume=REFUSE)
    lr: float = option(1e-3, "peak learning rate (before --scale-lr)", resume=FLAG)
    weight_decay: float = option(0.0, "weight decay", resume=FLAG)
    momentum: float = option(0.9, "SGD momentum", resume=FLAG)
    schedule: str = option("cosine", "learning-rate schedule after warm-up", SCHEDULES, resume=FLAG)
    warmup_steps: int = option(0, "linear warm-up steps", resume=FLAG)
    scale_lr: bool = option(False, "multiply the learning rate by the world size (linear scaling rule)", resume=FLAG)
    grad_accum_steps: int = option(1, "micro-batches per optimizer step (gradients synchronised once)", resume=FLAG)
    fused_optimizer: bool = option(True, "PyTorch's fused kernel for the optimizer where it has one (CPU, CUDA): "
                                         "faster, and no read of the step count into Python every step; a resume "
                                         "keeps the kernel its checkpoint was written with")
    clip_grad_norm: float = option(0.0, "clip the gradient norm to this value (0: off)", resume=FLAG)
    precision: str = option("fp32", "fp32 (on CUDA: no TF32), tf32 (fp32 with TF32 matmuls and convolutions on "
                                    "CUDA; fp32 on CPU), bf16 autocast (CPU and GPU) or fp16 with a grad scaler (GPU)",
                            PRECISIONS, resume=FLAG)

    def __post_init__(self) -> None:
        check_choice(self.optimizer, "optimizer", OPTIMIZERS)
        check(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        check_choice(self.schedule, "schedule", SCHEDULES)
        check(self.warmup_steps >= 0, "--warmup-steps must be >= 0")
        check(self.grad_accum_steps >= 1, f"--grad-accum-steps must be >= 1, got {self.grad_accum_steps}")
        check(self.clip_grad_norm >= 0, "--clip-grad-norm must be >= 0")
        check_choice(self.precision, "precision", PRECISIONS)


@dataclass
class TrainConfig:
    epochs: int = option(3, "number of epochs")
    batch_size: int = option(128, "samples per rank per micro-batch (not used with --global-batch-size)", resume=FLAG)
    global_batch_size: int = option(0, "samples per optimizer step across all ranks, whatever their number: each "
                                       "rank's micro-batch is this / (ranks x --grad-accum-steps), so a resume or an "
                                       "elastic job at another world size keeps its steps (0: --batch-size per rank)",
                                    resume=FLAG)
    eval_batch_size: int = option(512, "samples per rank per evaluation batch")
    eval_every: int = option(0, "also evaluate every N optimizer steps, mid-epoch (0: at the end of each epoch only)")
    max_steps: int = option(0, "stop (with a checkpoint) once this many optimizer steps are done in total; "
                                "the LR schedule still spans --epochs (0: no limit)")
    seed: int = option(0, "random seed (same seed and world size: bitwise the same run on CPU)", resume=FLAG)
    sync: str = option("ddp", "gradient synchronisation method", SYNC_METHODS)

    def __post_init__(self) -> None:
        check(self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}")
        check(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        check(self.global_batch_size >= 0, f"--global-batch-size must be >= 0 (0: off), got {self.global_batch_size}")
        check(self.eval_batch_size >= 1, "--eval-batch-size must be >= 1")
        check(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        check(self.max_steps >= 0, "--max-steps must be >= 0")
        check_choice(self.sync, "sync", SYNC_METHODS)

    def divides(self, world_size: int, accum: int) -> bool:
        """Whether --global-batch-size (if given) splits evenly into world_size ranks x accum micro-batches."""
        parts = world_size * accum
        return not self.global_batch_size or (self.global_batch_size >= parts and self.global_batch_size % parts == 0)

    def per_rank_batch(self, world_size: int, accum: int) -> int:
        """Samples per rank per micro-batch at this world size: --batch-size, or --global-batch-size's share."""
        if not self.global_batch_size:
            return self.batch_size
        check(self.divides(world_size, accum),
              f"--global-batch-size {self.global_batch_size} does not divide into {world_size} rank(s) x {accum} "
              f"micro-batch(es) per step; give a multiple of {world_size * accum} (for an elastic job, one that "
              f"ranks x --grad-accum-steps divides at every world size it may run at)")
        return self.global_batch_size // (world_size * accum)


@dataclass
class DistConfig:
    device: str = option("auto", "auto: cuda:LOCAL_RANK when CUDA is present, else cpu", ("auto", "cpu", "cuda"))
    backend: str = option("auto", "auto: nccl on CUDA, gloo on CPU", ("auto", "gloo", "nccl"))
    rendezvous_timeout_s: float = option(300.0, "how long to wait for the master address to accept connections")
    collective_timeout_s: float = option(600.0, "timeout of init_process_group and of each collective")
    threads_per_rank: int = option(0, "torch threads per rank, on any device (0: OMP_NUM_THREADS, else cores / local "
                                          "ranks)")
    master_port: int = option(0, "the master's TCP port where the launcher names none (Slurm's srun); 0: MASTER_PORT, "
                                 "else 20000 + the job id mod 10000")
    job_id: str = option("", "this job's name for the checkpoint folder's lease, the same for all its restarts and "
                             "no other job's (default: DDP_JOB_ID, else the launcher's: Slurm's job id, torchrun's "
                             "run id, the master's address)", resume=ResumeRule.IGNORE)

    def __post_init__(self) -> None:
        check_choice(self.device, "device", ("auto", "cpu", "cuda"))
        check_choice(self.backend, "backend", ("auto", "gloo", "nccl"))
        check(self.rendezvous_timeout_s > 0, "--rendezvous-timeout-s must be > 0")
        check(self.collective_timeout_s > 0, "--collective-timeout-s must be > 0")
        check(self.threads_per_rank >= 0, "--threads-per-rank must be >= 0")
        check(0 <= self.master_port <= 65535, f"--master-port {self.master_port}: a TCP port is 1-65535 (0: derived)")


@dataclass
class CheckpointConfig:
    checkpoint_dir: str = option("", "checkpoint folder or fsspec URL (default: OUTPUT_DIR/checkpoints)")
    checkpoint_every: int = option(0, "also save every N optimizer steps (0: only at the end of each epoch)")
    checkpoint_every_s: float = option(0.0, "also save once this many seconds have passed since the last save, at a "
                                            "step every rank agrees on (0: off); bounds the work a lost node costs "
                                            "whatever a step takes")
    keep_last: int = option(3, "how many recent checkpoints to keep (>= 2)")
    keep_best: bool = option(False, "also keep the checkpoint with the best value of the task's monitored metric")
    resume: str = option("latest", "latest (newest valid checkpoint, if any), none, or a checkpoint path",
                         resume=ResumeRule.IGNORE)
    allow_resume_change: str = option(
        "", "settings a resume may change although they change the training, comma-separated (lr,batch_size); "
        "see docs/checkpoints.md for what a resume always allows and always refuses", resume=ResumeRule.IGNORE)
    init_from: str = option("", "a fresh run starts from the model weights of this torch.distributed.checkpoint folder "
                                "(another tool's, TorchTitan's layout, or one of ours); a resume ignores it",
                            resume=ResumeRule.IGNORE)
    async_checkpoint: bool = option(False, "write checkpoints in a background thread")
    grace_period_s: float = option(25.0, "after SIGTERM, exit within this many seconds (checkpoint included)")
    checkpoint_timeout_s: float = option(1800.0, "a checkpoint write that takes longer (a hung NFS mount or bucket) "
                                                 "ends the job with exit 200, to be restarted from the last "
                                                 "complete checkpoint", resume=ResumeRule.IGNORE)
    max_failed_saves: int = option(3, "a save that fails on a storage error a retry may fix (I/O error, throttling, "
                                      "5xx) is a warning and training goes on; after this many in a row the job "
                                      "ends with exit 200, to be restarted from the last committed checkpoint",
                                   resume=ResumeRule.IGNORE)
    max_attempts_without_progress: int = option(
        10, "a job whose last N attempts failed (or were killed) without committing a checkpoint past where each "
           "started is not retried again: its next attempt exits 2 (0: no limit)", resume=ResumeRule.IGNORE)
    lease_expiry_s: float = option(60.0, "a checkpoint folder belongs to one job; the lease of a job killed without "
                                         "releasing it is free after this many seconds without renewal",
                                  resume=ResumeRule.IGNORE)
    take_over_checkpoint_dir: bool = option(False, "take the checkpoint folder from the job that holds its lease "
                                                   "now (only when that job is gone)",
                                            resume=ResumeRule.IGNORE)

    def __post_init__(self) -> None:
        check(self.checkpoint_every >= 0, "--checkpoint-every must be >= 0")
        check(math.isfinite(self.checkpoint_every_s) and self.checkpoint_every_s >= 0,
              f"--checkpoint-every-s must be a number of seconds >= 0 (0: off), got {self.checkpoint_every_s:g}")
        check(self.keep_last >= 2, f"--keep-last must be >= 2 (a crash during a save needs a fallback), "
                                   f"got {self.keep_last}")
        check(bool(self.resume), "--resume must be latest, none or a path")
        check(self.grace_period_s > 0, "--grace-period-s must be > 0")
        check(self.checkpoint_timeout_s > 0, f"--checkpoint-timeout-s must be > 0, got {self.checkpoint_timeout_s:g}")
        check(self.max_failed_saves >= 1, f"--max-failed-saves must be >= 1 (1: the first failed save ends the job), "
                                          f"got {self.max_failed_saves}")
        check(self.max_attempts_without_progress >= 0, f"--max-attempts-without-progress must be >= 0 (0: no "
                                                       f"limit), got {self.max_attempts_without_progress}")
        check(self.lease_expiry_s >= 4, f"--lease-expiry-s must be >= 4 (it is renewed every quarter of it), "
                                        f"got {self.lease_expiry_s:g}")

    def allowed_changes(self) -> set[str]:
        return {name.strip().replace("-", "_") for name in self.allow_resume_change.split(",") if name.strip()}


@dataclass
class OutputConfig:
    output_dir: str = option("runs/default", "folder for metrics.jsonl, TensorBoard events, config and summary")
    log_every: int = option(20, "log a metrics line every N optimizer steps")
    progress: str = option("auto", "progress bar on rank 0: auto (when a terminal), on, off", ("auto", "on", "off"))
    tensorboard: bool = option(True, "write TensorBoard event files")
    sample_log: bool = option(False, "record every training sample index each rank consumes (audit of resume)")
    profile_steps: str = option("", "A-B: write a torch.profiler trace of optimizer steps A to B (counted from the "
                                    "run's first, 1-based, resumes included) for each rank to OUTPUT_DIR/profiles; "
                                    "on CUDA a memory snapshot too")
    memory_snapshot_on_oom: bool = option(False, "on CUDA, record the allocator's history from the start and write "
                                                 "it to OUTPUT_DIR/profiles/rank-R.oom.memory.pickle if the rank "
                                                 "runs out of memory (a little slower while on)")
    peak_tflops: float = option(0.0, "one device's dense peak in TFLOP/s at this run's --precision (its datasheet's, "
                                     "without sparsity), for the MFU in the log and summary (0: from the trainer's "
                                     "table of GPUs, trainer/throughput.py; none for CPUs)")
    slow_rank_every: int = option(10, "every N optimizer steps the ranks compare their data waits and forward times "
                                      "(trainer/slow_rank.py); a rank slower than the others' median by "
                                      "--slow-rank-ratio in 3 comparisons in a row is named in the log and "
                                      "metrics.jsonl (0: off)")
    slow_rank_ratio: float = option(1.4, "how many times the other ranks' median a rank's data wait or forward time "
                                         "must be to count as slow (> 1; an even run's ranks drift apart by up to "
                                         "1.3x on a machine shared with other work)")
    metrics_port: int = option(0, "serve Prometheus metrics over HTTP (0: off): local rank 0 at --metrics-host:PORT, "
                                  "with its node's other ranks, which listen on 127.0.0.1 at PORT + local rank "
                                  "(docs/tracking.md)")
    metrics_host: str = option("::", "the address local rank 0's metrics endpoint listens on (::: every IPv6 and "
                                     "IPv4 address of this machine, or every IPv4 one, 0.0.0.0, where the kernel has "
                                     "no IPv6; 0.0.0.0: every IPv4 one; 127.0.0.1: this machine only)")

    def __post_init__(self) -> None:
        check(self.log_every >= 1, "--log-every must be >= 1")
        check(self.slow_rank_every >= 0, f"--slow-rank-every must be a number of steps >= 0 (0: off), "
                                         f"got {self.slow_rank_every}")
        check(math.isfinite(self.slow_rank_ratio) and self.slow_rank_ratio > 1,
              f"--slow-rank-ratio must be a number > 1 (1.4: 40% slower than the others' median), "
              f"got {self.slow_rank_ratio:g}")
        check(math.isfinite(self.peak_tflops) and self.peak_tflops >= 0,
              f"--peak-tflops must be a number of TFLOP/s >= 0 (0: from the table), got {self.peak_tflops:g}")
        check(0 <= self.metrics_port <= 65535, f"--metrics-port {self.metrics_port}: a TCP port is 1-65535 (0: off)")
        check(bool(self.metrics_host.strip()), "--metrics-host must be an address (::, the default: all of this "
                                                "machine's)")
        check_choice(self.progress, "progress", ("auto", "on", "off"))
        self.profile_range  # noqa: B018 - validates the flag now

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """--profile-steps as (first, last) optimizer steps, both included; None when off."""
        if not self.profile_steps.strip():
            return None
        first, dash, last = self.profile_steps.strip().partition("-")
        if not (dash and first.strip().isdigit() and last.strip().isdigit()
                and 1 <= int(first) <= int(last)):
            raise ConfigError(f"--profile-steps must be A-B, optimizer steps with 1 <= A <= B (for example 10-12), "
                              f"got {self.profile_steps!r}")
        return int(first), int(last)


@dataclass
class TrackingConfig:
    """Experiment trackers beside metrics.jsonl and TensorBoard (trainer.tracking). None of it changes the training,
    so a resume may change any of it. Credentials are never settings: each tracker reads its own environment
    variables (MLFLOW_TRACKING_TOKEN, WANDB_API_KEY, ...)."""

    tracker: str = option("", "experiment trackers that rank 0 reports to as well, comma-separated: "
                              "mlflow, wandb (metrics.jsonl and TensorBoard are written as always)",
                          resume=ResumeRule.IGNORE)
    tracking_uri: str = option("", "MLflow's tracking server (default: MLFLOW_TRACKING_URI)",
                               resume=ResumeRule.IGNORE)
    experiment: str = option("", "the MLflow experiment and the W&B project (default: MLFLOW_EXPERIMENT_NAME or "
                                 "WANDB_PROJECT, else ddp-deploy)", resume=ResumeRule.IGNORE)
    run_name: str = option("", "the tracker run's name (default: the output folder's name)",
                           resume=ResumeRule.IGNORE)
    tracker_checkpoints: bool = option(False, "once the run ends, upload its newest checkpoint to the MLflow run's "
                                              "artifacts", resume=ResumeRule.IGNORE)
    tracker_timeout_s: float = option(60.0, "how long a tracker may take to start (its client library's import "
                                            "not counted), and to take the last records at the end; past it, the "
                                            "start fails (exit 2) and the end warns",
                                      resume=ResumeRule.IGNORE)

    def __post_init__(self) -> None:
        for name in self.trackers:
            check_choice(name, "tracker", TRACKERS)
        check(len(set(self.trackers)) == len(self.trackers), f"--tracker {self.tracker!r} names a tracker twice")
        check(not self.tracker_checkpoints or "mlflow" in self.trackers,
              "--tracker-checkpoints uploads to MLflow; add mlflow to --tracker, or drop --tracker-checkpoints")
        check(self.tracker_timeout_s > 0, f"--tracker-timeout-s must be > 0, got {self.tracker_timeout_s:g}")

    @property
    def trackers(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.tracker.split(",") if name.strip())


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "dist": DistConfig,
    "checkpoint": CheckpointConfig,
    "output": OutputConfig,
    "tracking": TrackingConfig,
}


@dataclass
class Config:
    """The trainer's sections (what to train is the run's trainer.task.RunTask, apart)."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.optim.precision == "fp16" and self.dist.device == "cpu":
            raise ConfigError("--precision fp16 needs a GPU; use --precision bf16 on CPU")
        if self.model.sync_bn and SYNC_METHODS.get(self.train.sync).one_process:
            raise ConfigError(f"--sync {self.train.sync} runs one process; --sync-bn needs several ranks "
                              f"(use --sync ddp)")
        accum, global_batch = self.optim.grad_accum_steps, self.train.global_batch_size
        if global_batch % accum:
            raise ConfigError(f"--global-batch-size {global_batch} does not divide into --grad-accum-steps {accum} "
                              f"micro-batches at any world size; give a multiple of {accum}")
        if global_batch and self.optim.scale_lr:
            raise ConfigError("--scale-lr multiplies the learning rate by the world size, but with "
                              "--global-batch-size the batch of a step does not grow with it; give the learning rate "
                              "for that global batch, without --scale-lr")
        if self.model.meta_init == "on" and not SYNC_METHODS.get(self.train.sync).sharded:
            raise ConfigError(f"--meta-init on builds the model in shards, which --sync {self.train.sync} does not "
                              f"keep; use --sync fsdp or hsdp, or --meta-init off")

    @property
    def checkpoint_location(self) -> str:
        """Where checkpoints go: --checkpoint-dir, or OUTPUT_DIR/checkpoints by default."""
        return self.checkpoint.checkpoint_dir or f"{self.output.output_dir.rstrip('/')}/checkpoints"

    def sections(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SECTIONS}

    def to_dict(self) -> dict[str, Any]:
        """One mapping per section, as the YAML file has them (trainer.cli adds the task's)."""
        return {name: as_dict(section) for name, section in self.sections().items()}
