"""A Ray node that drains, told to the trainer in each worker on it.

``ray drain-node``, the autoscaler's scale-down and a cloud's reclaim of a spot instance (where Ray learns of it)
mark the node draining in the GCS, with the deadline by which it goes. No signal tells the trainer (Ray runs it in a
thread of its worker, and signals reach the main thread only), so each worker watches its own node's entry and,
once it is there, asks the trainer to stop (trainer.preemption.StopRequests): every rank stops at the next step,
writes a checkpoint and exits with EXIT_PREEMPTED, within the deadline. train_in_worker raises on that exit, Ray
starts the worker group again where it can (never on a draining node), and the group resumes from that checkpoint.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

from trainer.errors import described
from trainer.on_ray.ray_internals import draining_nodes, this_node_id
from trainer.preemption import StopRequest, StopRequests
from trainer.redact import redact

__all__ = ["drain_request", "stop_when_this_node_drains"]

# One small GCS request per worker per second: a drain's deadline is tens of seconds or more (a spot reclaim's
# notice: AWS 120 s, GCP 30 s), and the step after the one in which it is seen is where the trainer stops.
POLL_S = 1.0


def drain_request(node_id: str, deadline_ms: int, now_unix_s: float, now_monotonic: float) -> StopRequest:
    """The stop a drain of ``node_id`` asks for; ``deadline_ms``: Ray's (Unix ms; 0: none), as seconds from now."""
    if not deadline_ms:
        return StopRequest(f"node {node_id} is draining (no deadline)")
    left_s = max(0.0, deadline_ms / 1000 - now_unix_s)
    return StopRequest(f"node {node_id} is draining (deadline in {left_s:.0f} s)", now_monotonic + left_s)


@contextlib.contextmanager
def stop_when_this_node_drains(requests: StopRequests, poll_s: float = POLL_S) -> Iterator[None]:
    """While the block runs, a thread that asks ``requests`` for a stop once this worker's node drains."""
    node_id = this_node_id()
    done = threading.Event()
    watch = threading.Thread(target=_watch, args=(node_id, requests, done, poll_s), name="ray-drain-watch",
                             daemon=True)
    watch.start()
    try:
        yield
    finally:
        done.set()
        watch.join(poll_s)  # at most one request to the GCS in flight; a daemon past that


def _watch(node_id: str, requests: StopRequests, done: threading.Event, poll_s: float) -> None:
    failing = False
    while True:
        try:
            deadline_ms = draining_nodes().get(node_id)
            failing = False
        except Exception as error:  # noqa: BLE001 - the GCS out of reach a moment: asked again at the next poll
            if not failing:
                print(redact(f"warning: could not ask Ray whether node {node_id} is draining ({described(error)}); "
                             f"asking again every {poll_s:g}s"), file=sys.stderr, flush=True)
            failing, deadline_ms = True, None
        if deadline_ms is not None:
            requests.ask(drain_request(node_id, deadline_ms, time.time(), time.monotonic()))
            return
        if done.wait(poll_s):
            return
