"""The preemption watcher: its signal handlers, only where signals arrive (the process's main thread); a launcher's
stop request, a signal by another name."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time

from devtools.processes import REPO_ROOT, clean_env
from trainer.errors import EXIT_PREEMPTED
from trainer.preemption import FORCED_EXIT_CLEANUP_S, PreemptionWatcher, StopRequest, StopRequests


def test_training_in_a_thread_installs_no_handler_and_says_stop_signals_are_the_launchers(runtime, caplog):
    """Ray Train runs the training function in a thread of each worker: signal.signal would raise there."""
    caplog.set_level(logging.INFO, logger="preemption-test")
    watcher = PreemptionWatcher(25.0, runtime, logging.getLogger("preemption-test"))
    before = signal.getsignal(signal.SIGTERM)
    failures: list[BaseException] = []

    def in_a_thread() -> None:
        try:
            watcher.install()
            watcher.uninstall()
        except BaseException as error:  # noqa: BLE001 - the test's own report of the thread's failure
            failures.append(error)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert failures == [] and signal.getsignal(signal.SIGTERM) is before
    assert "stop signals are the launcher's" in caplog.text


def test_in_the_main_thread_sigterm_is_the_watchers_until_uninstalled(runtime):
    watcher = PreemptionWatcher(25.0, runtime, logging.getLogger("preemption-test"))
    before = signal.getsignal(signal.SIGTERM)
    watcher.install()
    try:
        assert signal.getsignal(signal.SIGTERM) == watcher._on_signal
    finally:
        watcher.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before


# -- a launcher's stop request (trainer.on_ray.drain: the worker's node drains) ------------------------------------

def test_a_stop_request_made_while_the_trainer_builds_stops_it_at_the_next_vote_saying_why(runtime, caplog):
    caplog.set_level(logging.INFO, logger="preemption-test")
    requests = StopRequests()
    requests.ask(StopRequest("node 1a2b is draining (deadline in 30 s)", time.monotonic() + 30))
    watcher = PreemptionWatcher(25.0, runtime, logging.getLogger("preemption-test"), requests)
    assert not watcher.should_stop(), "not before the watcher listens"
    watcher.install()
    try:
        assert watcher.should_stop() and watcher.asked_here
        assert watcher.describe() == "node 1a2b is draining (deadline in 30 s)"
        assert "node 1a2b is draining (deadline in 30 s): stopping at the next step" in caplog.text
    finally:
        watcher.uninstall()


def test_a_requests_deadline_bounds_the_grace_period_and_none_leaves_it_whole(runtime):
    bounded, whole = StopRequests(), StopRequests()
    exit_by = time.monotonic() + 5
    watchers = [PreemptionWatcher(25.0, runtime, logging.getLogger("preemption-test"), requests)
                for requests in (bounded, whole)]
    for watcher in watchers:
        watcher.install()
    try:
        asked = time.monotonic()
        bounded.ask(StopRequest("node 1a2b is draining (deadline in 5 s)", exit_by))
        whole.ask(StopRequest("node 3c4d is draining (no deadline)"))
        deadline_bounded, deadline_whole = (watcher.exit_deadline() for watcher in watchers)
        assert deadline_bounded is not None and deadline_bounded <= exit_by - FORCED_EXIT_CLEANUP_S
        assert deadline_whole is not None and deadline_whole >= asked + 25.0 - FORCED_EXIT_CLEANUP_S
    finally:
        for watcher in watchers:
            watcher.uninstall()


def test_a_request_after_the_run_ended_is_nobodys(runtime):
    requests = StopRequests()
    watcher = PreemptionWatcher(25.0, runtime, logging.getLogger("preemption-test"), requests)
    watcher.install()
    watcher.uninstall()
    requests.ask(StopRequest("node 1a2b is draining (deadline in 30 s)", time.monotonic() + 30))
    assert not watcher.should_stop() and watcher.exit_deadline() is None


# A process whose trainer never reaches a step boundary after the request (stuck in a save, say): it must be gone
# by the drain's deadline, with the retryable code, whatever --grace-period-s says.
STUCK_PAST_THE_DEADLINE = """
import logging, sys, time
import torch
from trainer.config import DistConfig
from trainer.distributed import init_process_group
from trainer.launchers import identity_from_env
from trainer.preemption import PreemptionWatcher, StopRequest, StopRequests

logging.basicConfig(stream=sys.stdout, level=logging.INFO)
runtime = init_process_group(DistConfig(), identity_from_env({}), torch.device("cpu"))
requests = StopRequests()
watcher = PreemptionWatcher(600.0, runtime, logging.getLogger("stuck"), requests)
watcher.install()
requests.ask(StopRequest("node 1a2b is draining (deadline in 1 s)", time.monotonic() + 1))
time.sleep(30)  # past any deadline here: exit 0 unless the forced exit came first
"""


def test_a_trainer_stuck_past_the_drains_deadline_exits_preempted_by_then():
    result = subprocess.run([sys.executable, "-c", STUCK_PAST_THE_DEADLINE], capture_output=True, text=True,
                            timeout=60, env=clean_env(), cwd=REPO_ROOT)
    assert result.returncode == EXIT_PREEMPTED, result.stdout + result.stderr
    assert "grace period of 1s over before the checkpoint finished" in result.stdout, result.stdout + result.stderr
