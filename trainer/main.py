"""Entry point: parse the config, join the group, build, train, always tear down.

Runs as ``python -m trainer``, as the ``ddp-train`` command, and as a script
(``torchrun trainer/main.py``, ``torchx run ... --script trainer/main.py``).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # started as a script: make the package importable from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from trainer.build import build_training
from trainer.checkpoint import CheckpointManager
from trainer.cli import dump_yaml, parse_config
from trainer.config import Config
from trainer.distributed import Runtime, choose_device, gather_to_main, process_group, threads_per_rank
from trainer.env import identity_from_env
from trainer.errors import EXIT_OK, EXIT_PEER_LOST, EXIT_PREEMPTED, Preempted, UserError, first_line
from trainer.loop import Trainer
from trainer.preemption import PreemptionWatcher
from trainer.report import final_line, setup_logging, write_summary


def train(config: Config, runtime: Runtime) -> dict[str, object]:
    log = setup_logging(runtime.identity)
    started = time.perf_counter()
    output_dir = Path(config.output.output_dir)
    if runtime.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(dump_yaml(config))
        log.info("config:\n%s", dump_yaml(config).rstrip())
    log.info("%s; device %s, backend %s, %d threads", runtime.identity.describe(), runtime.device, runtime.backend,
             torch.get_num_threads())

    watcher = PreemptionWatcher(config.checkpoint.grace_period_s, runtime.device, log)
    watcher.install()  # before the slow parts, so an early SIGTERM is not lost
    checkpoints = CheckpointManager(config.checkpoint, config.checkpoint_dir, runtime, log)
    checkpoints.prepare()
    setup = build_training(config, runtime)
    trainer = Trainer(config, runtime, setup, checkpoints, watcher, log)
    try:
        loaded = checkpoints.load(config.checkpoint.resume)
        if loaded is not None:
            trainer.restore(loaded)
        samples_before = trainer.position.samples_seen
        result = trainer.fit()
    finally:
        trainer.close()
        watcher.uninstall()
    wall_time_s = time.perf_counter() - started
    summary = {
        "test_accuracy": result.accuracy,
        "test_loss": result.loss,
        "test_samples": result.samples,
        "world_size": runtime.identity.world_size,
        "ranks": _all_identities(runtime),
        "global_step": trainer.position.step,
        "epochs_completed": trainer.position.epoch,
        "resumed_from": trainer.resumed_from,
        "wall_time_s": round(wall_time_s, 3),
        "train_samples_per_s": round((trainer.position.samples_seen - samples_before) / wall_time_s, 1),
    }
    if runtime.is_main:
        write_summary(output_dir, summary)
        print(final_line(summary), flush=True)
    return summary


# What gloo and NCCL say when a peer process is gone; such an error is the other rank's story, not this one's.
PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|Connection refused|"
                       r"NCCL communicator was aborted|Timed out waiting|timed out|DistNetworkError", re.IGNORECASE)


def _all_identities(runtime: Runtime) -> list[dict[str, object]]:
    return gather_to_main(runtime.identity.to_dict(), runtime) or []


def main(argv: Sequence[str] | None = None) -> int:
    rank = os.environ.get("RANK", "0")
    try:
        config = parse_config(argv)
        identity = identity_from_env(os.environ)
        rank = str(identity.rank)
        device = choose_device(config.dist, identity)
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(config.dist, identity, dict(os.environ)))
        with process_group(config.dist, identity, device) as runtime:
            train(config, runtime)
        return EXIT_OK
    except UserError as error:
        print(f"[rank {rank}] error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    except RuntimeError as error:
        first = first_line(error)
        if not (isinstance(error, torch.distributed.DistError) or PEER_LOST.search(first)):
            raise
        print(f"[rank {rank}] error: lost contact with another rank ({first[:300]}); it probably crashed or "
              f"was stopped, and its own log says why. Checkpoints are intact; exiting with {EXIT_PEER_LOST} so "
              f"the launcher can restart the job", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    except Preempted as stopped:
        print(f"[rank {rank}] {stopped}; exiting with {EXIT_PREEMPTED} so the launcher retries", file=sys.stderr,
              flush=True)
        return EXIT_PREEMPTED


if __name__ == "__main__":
    sys.exit(main())
