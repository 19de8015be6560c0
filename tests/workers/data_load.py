"""Run by the distributed data tests under torchrun: join the group, load_datasets, print what each rank got.

Usage: python -m tests.workers.data_load [trainer flags]. Each output line starts with [rank N].
DATA_TEST_DATA_DIR_RANK_<N>, when set, replaces --data-dir on rank N only: a node whose local
folder differs from the others'.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from trainer.cli import parse_config
from trainer.data import load_datasets
from trainer.distributed import process_group
from trainer.errors import UserError
from trainer.launchers import identity_from_env


def main() -> int:
    identity = identity_from_env(os.environ)
    prefix = f"[rank {identity.rank}]"
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format=f"{prefix} %(name)s: %(message)s")
    argv = sys.argv[1:]
    override = os.environ.get(f"DATA_TEST_DATA_DIR_RANK_{identity.rank}")
    if override:
        argv = [*argv, "--data-dir", override]
    config, task = parse_config(argv)
    try:
        with process_group(config.dist, identity, torch.device("cpu")) as runtime:
            train, test, info = load_datasets(task.options, runtime)
    except UserError as error:
        say(f"{prefix} error: {error}")
        return error.exit_code
    say(f"{prefix} loaded {info.name}: {len(train)} train, {len(test)} test, label sum {int(train.labels.sum())}")
    return 0


def say(line: str) -> None:
    """One write per line: both ranks share torchrun's stdout, and print() writes the text and the newline
    separately, so under load another rank's line could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
