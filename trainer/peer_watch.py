"""Which peer processes are gone (ended, or their machine lost), known within milliseconds rather than after a
heartbeat has been silent for --collective-timeout-s.

A rank that waits for others in the store (trainer.liveness.wait_for_all: rank 0's checkpoint write, a node's
download) sees a dead peer and a frozen one alike: both stop beating. But a dead process's connections close,
and a frozen one's do not. So each rank keeps a receive open from the next rank around the ring, on a gloo group
of its own that nothing ever sends on: it can only end with the connection's end ("Connection closed by peer").
The watcher notes the peer as gone and moves on to the rank after it: a lost node's ranks are all found by the
surviving rank before them. A rank that waits in the store publishes what its own watch found there, and reads
what the others' found (trainer.liveness): the watcher itself never touches the store, so that nothing of it is
left inside a store call when the process ends. One thread per rank, whatever the world size; a frozen peer is
still found by its silent heartbeat.
"""

from __future__ import annotations

import re
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.launchers import DistIdentity

GONE_KEY = "ddp-deploy/gone/"
# A receive nobody answers ends at the group's timeout: long, and then it is posted again.
WATCH_TIMEOUT = timedelta(days=7)
# gloo's words for a connection whose other end closed: the process ended (or its machine is gone).
CLOSED = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe", re.IGNORECASE)
TIMED_OUT = re.compile(r"Timed out|timeout", re.IGNORECASE)


def gone_key(rank: int) -> str:
    return f"{GONE_KEY}{rank}"


class PeerWatch:
    def __init__(self, identity: DistIdentity) -> None:
        self.identity = identity
        # A collective: every rank makes it, in the same order as the others' groups.
        self.group = dist.new_group(backend="gloo", timeout=WATCH_TIMEOUT)
        self._gone: dict[int, str] = {}  # rank: how it went (gloo's words)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="peer-watch", daemon=True)
        self._thread.start()

    def found(self) -> dict[int, str]:
        """The peers this rank's watch found gone so far, and how."""
        with self._lock:
            return dict(self._gone)

    def _watch(self) -> None:
        rank, world = self.identity.rank, self.identity.world_size
        peer = (rank + 1) % world
        while peer != rank:
            try:
                dist.irecv(torch.zeros(1), src=peer, group=self.group).wait()
                continue  # nothing sends on this group: never reached, but a message would not mean gone
            except RuntimeError as error:
                if not CLOSED.search(str(error)):
                    if TIMED_OUT.search(str(error)):
                        continue  # the receive's timeout (a week): post it again
                    return  # the group is being destroyed, this process ends: nothing more to watch
                said = " ".join(str(error).split())[:300]
            with self._lock:
                self._gone[peer] = f"its connection closed ({said})"
            peer = (peer + 1) % world
