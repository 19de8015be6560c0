"""Heartbeats in one process, two ranks on a real TCPStore: long work on a live rank is waited for past the
silence limit, a silent rank is named with what it was doing."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from trainer.errors import PeerLost
from trainer.launchers import DistIdentity
from trainer.liveness import Liveness

pytestmark = pytest.mark.timeout(60)  # a wait that watched no heartbeat would hang: fail it quickly instead


@pytest.fixture
def ranks():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    # Beats 5 times faster than the trainer's, so that the tests take seconds: silent after 0.6 s.
    both = [Liveness(store, DistIdentity(rank, 0, 2, 1, rank, 2, "127.0.0.1", store.port, "env", "h"), 0.6,
                     beat_every_s=0.2) for rank in (0, 1)]
    yield both
    for liveness in both:
        liveness.close()


def test_long_work_on_a_rank_that_keeps_beating_is_waited_for_past_the_silence_limit(ranks):
    waiter, worker = ranks

    def work() -> None:
        with worker.busy("writing checkpoint step-00000004"):
            time.sleep(1.6)  # more than twice the 0.6 s a silent rank is given
        worker.wait_for_all("the save")

    thread = threading.Thread(target=work)
    thread.start()
    started = time.monotonic()
    waiter.wait_for_all("the save")
    assert 1.5 < time.monotonic() - started < 5
    thread.join()


def test_a_rank_whose_heartbeat_stops_is_named_with_its_step_and_work(ranks):
    waiter, stalled = ranks
    stalled.step = 7
    with stalled.busy("downloading data"):
        time.sleep(0.5)  # beats with the new state
        stalled.close()  # what SIGSTOP does to the heartbeat thread
    started = time.monotonic()
    with pytest.raises(PeerLost, match=r"rank 1 stopped responding while the others waited for the dataset: no "
                                       r"heartbeat for 0.6s .*last at step 7 while downloading data"):
        waiter.wait_for_all("the dataset")
    assert time.monotonic() - started < 3


def test_after_a_timeout_a_silent_rank_is_told_apart_from_one_that_is_elsewhere(ranks):
    waiter, other = ranks
    waiter.step, other.step = 12, 11
    time.sleep(0.5)
    assert "rank 1 is alive but at step 11, starting" in waiter.diagnose(30, watch_s=1)
    other.close()
    assert "rank 1 stopped responding (no heartbeat for 1s, last at step 11" in waiter.diagnose(30, watch_s=1)


def test_the_stores_keys_stay_bounded_however_many_rounds_are_waited_for(ranks):
    """Each save's wait adds a key per rank; a long job must not grow the store by two keys a save forever."""
    waiter, other = ranks
    store = waiter._store
    thread = threading.Thread(target=lambda: [other.wait_for_all(f"save {n}") for n in range(40)])
    thread.start()
    for n in range(40):
        waiter.wait_for_all(f"save {n}")
        assert store.num_keys() <= 2 + 2 * 2 + 2, n  # heartbeats, two rounds of 2 ranks, the store's own
    thread.join()
