"""The tracker seam in one process, with a tracker of the test's own: records carry the time they were made, a
tracker that hangs cannot grow the queue of its calls without end; and MLflow's reachability check goes through
the proxy its client would use. (The real servers' tests: tests/integration/test_trackers.py.)"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from trainer.config import TrackingConfig
from trainer.errors import TrackerError
from trainer.seams import TRACKERS
from trainer.trackers.mlflow import _check_reachable
from trainer.tracking import Tracker, TrackerRun, Tracking


class Slow(Tracker):
    """Takes each record when the test lets it: ``gate`` set; fails at step ``fail_at``."""

    gate = threading.Event()
    records: list[tuple[int, float, float]] = []  # (step, made_at, when the tracker got it)
    fail_at = 0
    ended: list[str] = []

    def start(self, run: TrackerRun, log: logging.Logger) -> str:
        return "slow-1"

    def log_metrics(self, kind: str, step: int, values: Mapping[str, float], made_at: float) -> None:
        self.gate.wait(60)
        if step == self.fail_at:
            raise ConnectionError("the server went away for a moment")
        self.records.append((step, made_at, time.time()))

    def log_summary(self, summary: Mapping[str, float], files: tuple[Path, ...]) -> None:
        pass

    def end(self, status: str) -> None:
        self.ended.append(status)


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[Slow]]:
    monkeypatch.setattr(TRACKERS, "_entries", dict(TRACKERS._filled()))  # the registry as it was, after the test
    TRACKERS.add("slow", Slow, "the test's own")
    Slow.gate, Slow.records, Slow.fail_at, Slow.ended = threading.Event(), [], 0, []
    yield Slow
    Slow.gate.set()


def test_a_record_keeps_the_time_it_was_made_and_a_hung_tracker_cannot_queue_without_end(slow, tmp_path, caplog,
                                                                                        monkeypatch):
    monkeypatch.setattr("trainer.tracking.QUEUED_CALLS", 50)
    tracking = Tracking(TrackingConfig(tracker="slow", tracker_timeout_s=5), tmp_path, True, logging.getLogger("t"))
    tracking.start({})
    started = time.monotonic()
    made = time.time()
    for step in range(1, 201):  # the tracker takes none of them yet: 50 wait, the rest are dropped
        tracking.log_metrics("train", step, {"loss": 1.0 / step})
    sent = time.time()
    assert time.monotonic() - started < 2  # training never waits for a tracker
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["tracker slow is 50 calls behind (hung?): what does not fit is dropped until it catches up; "
                        "metrics.jsonl has every record"]
    releasing = threading.Timer(0.2, slow.gate.set)  # the records wait, as behind a slow server, then it recovers
    releasing.start()
    tracking.close("FINISHED")  # its queue is full: the end waits for room, it is not dropped
    releasing.join()
    assert slow.ended == ["FINISHED"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[1:] == [f"tracker slow ended its run; {200 - len(slow.records)} record(s) were dropped while it "
                            f"was behind; metrics.jsonl has every record"]
    steps = [step for step, _, _ in slow.records]
    # The oldest 50 kept, in order; where the tracker took its first record while the loop ran, a later one took
    # the place it freed (a record between them was dropped: seen in CI as [1, ..., 50, 52]).
    assert steps[:50] == list(range(1, 51)) and steps == sorted(set(steps)) and len(steps) <= 52, steps
    # Stamped when made, not when the tracker got them (at least 0.2 s later, after the gate opened).
    assert all(made <= made_at < sent and taken - made_at >= 0.2 for _, made_at, taken in slow.records)


@pytest.fixture
def listening() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    yield server.getsockname()[1]
    server.close()


@pytest.fixture
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def closed_port() -> int:
    """A port nothing listens on (it was bound a moment ago)."""
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    return port


def test_the_tracking_servers_reachability_is_checked_through_the_proxy_its_client_uses(listening, no_proxies):
    """A server only a proxy reaches (a name this host cannot resolve) is reachable; NO_PROXY sends it direct."""
    monkeypatch = no_proxies
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{listening}")
    _check_reachable("http://tracking.invalid:5000", 5)
    monkeypatch.setenv("NO_PROXY", "tracking.invalid")
    with pytest.raises(TrackerError, match="cannot reach the tracking server http://tracking.invalid:5000 \\("):
        _check_reachable("http://tracking.invalid:5000", 5)
    monkeypatch.delenv("NO_PROXY")
    port = closed_port()
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    proxied = f"through the proxy http://127.0.0.1:{port} \\(HTTP_PROXY\\).*or the proxy$"
    with pytest.raises(TrackerError, match=proxied):
        _check_reachable("http://tracking.invalid:5000", 5)


def test_after_a_failure_a_tracker_is_sent_nothing_but_its_end(slow, tmp_path, caplog):
    """One warning for the failure, no more records, and the run is still ended (not left RUNNING)."""
    slow.gate.set()
    slow.fail_at = 2
    tracking = Tracking(TrackingConfig(tracker="slow", tracker_timeout_s=5), tmp_path, True, logging.getLogger("t"))
    tracking.start({})
    for step in (1, 2, 3):
        tracking.log_metrics("train", step, {"loss": 1.0})
    tracking.close("FINISHED")
    assert [step for step, _, _ in slow.records] == [1] and slow.ended == ["FINISHED"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tracker slow failed while logging step 2" in warnings[0], warnings


def test_a_proxy_named_by_all_proxy_or_without_a_scheme_is_used_and_its_password_never_shown(listening, no_proxies):
    monkeypatch = no_proxies
    monkeypatch.setenv("ALL_PROXY", f"127.0.0.1:{listening}")  # requests reads it, and a bare host:port
    _check_reachable("http://tracking.invalid:5000", 5)
    monkeypatch.delenv("ALL_PROXY")
    port = closed_port()
    monkeypatch.setenv("HTTP_PROXY", f"alice:PROXYPW2@127.0.0.1:{port}")
    with pytest.raises(TrackerError) as raised:
        _check_reachable("http://tracking.invalid:5000", 5)
    assert "PROXYPW2" not in str(raised.value) and f"alice:***@127.0.0.1:{port}" in str(raised.value)


class Loading(Slow):
    """A client library that takes ``load_s`` to import (or fails to: ``broken``) and a server ``start_s`` to
    answer."""

    load_s, start_s, broken = 0.0, 0.0, None

    def load(self) -> None:
        time.sleep(self.load_s)
        if self.broken is not None:
            raise self.broken

    def start(self, run: TrackerRun, log: logging.Logger) -> str:
        time.sleep(self.start_s)
        return "loading-1"


@pytest.mark.parametrize(("load_s", "start_s", "broken", "error"), [
    (0.6, 0.0, None, None),  # a slow import is not the server's silence
    (0.0, 0.6, None, "--tracker loading: no answer within 0.3 s; start the tracker or fix its address, raise "
                     "--tracker-timeout-s, or run without --tracker loading"),
    (0.0, 0.0, ModuleNotFoundError("No module named 'loading'"),
     "--tracker loading needs its client library (No module named 'loading'); install it with pip install "
     "'ddp-deploy[loading]'"),
    (0.0, 0.0, TypeError("Descriptors cannot be created directly.\nIf this call came from a _pb2.py file"),
     "--tracker loading: its client library fails to load (TypeError: Descriptors cannot be created directly.); "
     "repair it (pip install 'ddp-deploy[loading]') or run without --tracker loading"),
])
def test_only_the_trackers_answer_is_timed_not_its_import(slow, tmp_path, monkeypatch, load_s, start_s, broken,
                                                         error):
    TRACKERS.add("loading", Loading, "the test's own")
    monkeypatch.setattr(Loading, "load_s", load_s)
    monkeypatch.setattr(Loading, "start_s", start_s)
    monkeypatch.setattr(Loading, "broken", broken)
    tracking = Tracking(TrackingConfig(tracker="loading", tracker_timeout_s=0.3), tmp_path, True,
                        logging.getLogger("t"))
    if error is None:
        tracking.start({})
        assert tracking.run_ids == {"loading": "loading-1"}
    else:
        with pytest.raises(TrackerError) as refused:
            tracking.start({})
        assert str(refused.value) == error
