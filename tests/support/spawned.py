"""Real processes for tests of collectives: ``spawned(target, [args of rank 0, args of rank 1, ...])``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.multiprocessing as mp

SPAWN = mp.get_context("spawn")  # a fresh interpreter per rank: nothing of the test process (threads, CUDA)


@contextmanager
def spawned(target: Callable[..., None], args_of_ranks: Sequence[tuple[Any, ...]]) -> Iterator[list[Any]]:
    """The ranks started; when the block ends (or fails), each joined for a while, then killed if still there."""
    processes = [SPAWN.Process(target=target, args=args) for args in args_of_ranks]
    for process in processes:
        process.start()
    try:
        yield processes
    finally:
        for process in processes:
            process.join(timeout=10)
            process.kill()
