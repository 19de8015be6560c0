"""The preemption watcher's signal handlers: only where signals arrive, the process's main thread."""

from __future__ import annotations

import logging
import signal
import threading

from trainer.preemption import PreemptionWatcher


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
