"""gloo's own words for a timed-out operation, from two real processes: the trainer must read each as a timeout
(diagnosed with the ranks' heartbeats, exit 200), never as a crash of its own (a traceback, exit 1)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from devtools.processes import free_port
from tests.support.spawned import SPAWN, spawned
from trainer.api import PEER_LOST, TIMED_OUT

pytestmark = pytest.mark.timeout(90)


def _rank(rank: int, port: int, errors: mp.Queue[dict[str, str]]) -> None:
    """Rank 1 sends nothing; rank 0 waits on a receive and, 0.3 s later, on a broadcast: the receive times out
    first, and gloo closes the pair under the broadcast."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=1))
    if rank == 1:
        time.sleep(2.5)
        return
    seen: dict[str, str] = {}

    def receive() -> None:
        try:
            dist.recv(torch.zeros(1), src=1)
        except RuntimeError as error:
            seen["recv"] = str(error)

    waiting = threading.Thread(target=receive)
    waiting.start()
    time.sleep(0.3)
    try:
        dist.broadcast(torch.zeros(1), src=1)
    except RuntimeError as error:
        seen["broadcast"] = str(error)
    waiting.join()
    errors.put(seen)


def test_an_operation_whose_pair_another_timeout_closed_is_read_as_a_timeout():
    errors, port = SPAWN.Queue(), free_port()
    with spawned(_rank, [(rank, port, errors) for rank in (0, 1)]):
        seen = errors.get(timeout=60)
    assert "Timed out waiting" in seen["recv"] and "Application timeout caused pair closure" in seen["broadcast"], seen
    for message in seen.values():
        assert TIMED_OUT.search(message) and PEER_LOST.search(message), message
