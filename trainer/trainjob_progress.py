"""TrainJob progress: what ``kubectl get trainjob`` shows of this run, sent to Kubeflow Trainer's status server.

Kubeflow Trainer 2.2 added the server (KEP-2779, kubeflow/trainer#3227; alpha, behind the controller's
TrainJobStatus feature gate). Its controller names the server in every trainer container
(trainer.launchers.trainjob), and a POST of ``{"trainerStatus": {...}}`` there, with the pod's projected token as
``Authorization: Bearer``, becomes the TrainJob's ``status.trainerStatus``. Where it is named, rank 0 reports by
itself; no flag turns it on, and it is not a tracker (trainer.tracking): nothing is lost when the server is not
there, metrics.jsonl keeps every record.

- What: the progress (a whole percentage of the run's samples, or of --max-steps where that ends the run first),
  the time remaining at the rate this process has measured, the newest training and evaluation metrics (each as
  a string, as the API has them: at most 256, names and values of at most 64 characters), the step, the epoch and
  the samples seen. 100 only once the run has finished.
- When: at once, then at most every REPORT_EVERY_S while something changed, and once more at the run's end.
- Never in the training's way: the loop only stores numbers; one thread of its own sends the newest state, which
  replaces a state not yet sent (nothing queues behind a slow server); an unreachable or refusing server is one
  warning for each kind of failure, then quiet retries with backoff; no exception reaches the training; the end
  waits for the last report at most FINAL_REPORT_S (less within a grace period).

Progress after a resume or an elastic resize (a new process resumes from the newest checkpoint either way): the
true progress, not the highest ever reported. The steps since that checkpoint are lost and trained again, and the
time remaining has to count them; holding the old maximum would hide the loss and freeze the bar for no visible
reason, and this process cannot know the last attempt's last report anyway (the server has no GET, and the
TrainJob is not the pod's to read). So every report of a resumed process names the checkpoint's step
(``resumed_from_step``), and the launcher's restart count where it has one (``restarts``): a lower percentage
always comes with its reason. Within one process the progress never goes down: it counts samples, which only
grow, and a change of world size changes the steps, not the samples.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainer.launchers.trainjob import StatusServer
from trainer.position import TrainingPosition
from trainer.redact import redact

__all__ = ["Plan", "TrainJobProgress", "estimated_remaining_s"]

# The controller's API client that writes the status is rate-limited for the whole cluster (qps 5, burst 10 by
# default in Trainer's chart), shared by every TrainJob; KEP-2779's own scrape design polled every 30 s. (Kubeflow's
# SDK throttles its callers to one report in 5 s.)
REPORT_EVERY_S = 30.0
LOOK_EVERY_S = 1.0  # how often the thread reads where training stands: the rate is measured from the first step
REQUEST_TIMEOUT_S = 10.0  # the server's own read and write timeouts (pkg/statusserver/server.go)
RETRY_AT_MOST_S = 300.0  # a server that is down is asked again after 2, 4, 8 ... times REPORT_EVERY_S, up to this
FINAL_REPORT_S = 5.0
MAX_METRICS, MAX_TEXT = 256, 64  # the TrainJob CRD's limits (pkg/apis/trainer/v1alpha1/trainjob_types.go)
MAX_SECONDS = 2**31 - 1  # estimatedRemainingSeconds is an int32
# Records' fields that the position reports itself, and evaluation's sample count.
LEFT_OUT = {"epoch", "samples_seen", "samples"}


@dataclass(frozen=True)
class Plan:
    """What 100% is: every sample of --epochs, or --max-steps optimizer steps where that comes first."""

    total_samples: int
    epochs: int
    max_steps: int = 0  # 0: no limit

    def fraction(self, samples_seen: int, step: int) -> float:
        """How much of the run is done, 0 to 1: of whichever limit ends it first, the larger share."""
        done = samples_seen / max(1, self.total_samples)
        if self.max_steps:
            done = max(done, step / self.max_steps)
        return min(1.0, max(0.0, done))


@dataclass(frozen=True)
class _Where:
    """Where training stood when the thread looked."""

    at: float  # time.monotonic()
    samples_seen: int
    step: int
    epoch: int


class TrainJobProgress:
    """Rank 0's reports to the TrainJob's status server; does nothing where ``server`` is None."""

    def __init__(self, server: StatusServer | None, log: logging.Logger, restarts: int = 0,
                 every_s: float = REPORT_EVERY_S, look_every_s: float = LOOK_EVERY_S) -> None:
        self.server = server
        self.enabled = server is not None
        self.log = log
        self.restarts = restarts  # the launcher's restart count: a reason for a lower progress
        self.every_s = every_s
        self.look_every_s = min(look_every_s, every_s)
        self.reports_taken = 0  # by the server, this run
        self._lock = threading.Lock()  # the newest records, written by the training thread, read by the sender
        self._records: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._finished = False
        self._warned: set[str] = set()
        self._failing = False
        self._thread: threading.Thread | None = None

    # -- the training thread's side: numbers stored, nothing waited for ------------------------------------
    def watch(self, position: TrainingPosition, plan: Plan, resumed_from_step: int | None) -> None:
        """Start reporting ``position`` (the loop's own, read by the thread as it changes) against ``plan``."""
        if not self.enabled:
            return
        start = _Where(time.monotonic(), position.samples_seen, position.step, position.epoch)
        self._thread = threading.Thread(target=self._serve, args=(position, plan, resumed_from_step, start),
                                        name="trainjob-progress", daemon=True)
        self._thread.start()

    def log_metrics(self, kind: str, values: Mapping[str, Any]) -> None:
        """A record of metrics.jsonl ("train" or "test"): the newest of each kind is reported."""
        if self.enabled:
            with self._lock:
                self._records[kind] = dict(values)

    @contextlib.contextmanager
    def run(self, end_by: Callable[[], float | None] = lambda: None) -> Iterator[TrainJobProgress]:
        """Sends the last report as the training ends: 100 if it finished, where it stopped otherwise."""
        finished = False
        try:
            yield self
            finished = True
        finally:
            self.close(finished, end_by())

    def close(self, finished: bool, end_by: float | None = None) -> None:
        """The last report, waited for FINAL_REPORT_S at most, or until ``end_by`` (time.monotonic())."""
        if self._thread is None:
            return
        self._finished = finished
        self._stop.set()
        deadline = time.monotonic() + FINAL_REPORT_S
        if end_by is not None:
            deadline = min(deadline, end_by)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self.log.info("TrainJob progress: the status server did not take the last report in time; the TrainJob "
                          "shows the one before")

    # -- the thread ----------------------------------------------------------------------------------------
    def _serve(self, position: TrainingPosition, plan: Plan, resumed_from_step: int | None, start: _Where) -> None:
        try:
            self._report_until_stopped(position, plan, resumed_from_step, start)
        except Exception as error:  # a bug here must never reach the training: said once, and reporting ends
            self.log.warning("TrainJob progress: reporting stopped (%s: %s); training goes on", type(error).__name__,
                             redact(str(error)))

    def _report_until_stopped(self, position: TrainingPosition, plan: Plan, resumed_from_step: int | None,
                              start: _Where) -> None:
        def look() -> _Where:
            return _Where(time.monotonic(), position.samples_seen, position.step, position.epoch)

        where, since = start, None  # since: the first look after this process's first step, for the rate
        due, failures, last_sent = start.at, 0, None
        while True:
            stopping = self._stop.is_set()
            if stopping:  # where the training ended, not where it was at the last look
                where = look()
            if since is None and where.step > start.step:
                since = where
            if stopping or where.at >= due:
                status = self._status(plan, where, since, resumed_from_step, finished=stopping and self._finished)
                if stopping or status != last_sent:
                    if self._send(status):
                        last_sent, failures, due = status, 0, where.at + self.every_s
                    else:
                        failures += 1
                        due = where.at + min(RETRY_AT_MOST_S, self.every_s * 2 ** failures)
            if stopping:
                return
            self._stop.wait(self.look_every_s)
            where = look()

    def _status(self, plan: Plan, where: _Where, since: _Where | None, resumed_from_step: int | None,
                finished: bool) -> dict[str, Any]:
        """trainerStatus without its time (so that an unchanged one is not sent again)."""
        done = plan.fraction(where.samples_seen, where.step)
        status: dict[str, Any] = {"progressPercentage": 100 if finished else min(99, math.floor(100 * done))}
        if finished:
            status["estimatedRemainingSeconds"] = 0
        elif since is not None:
            remaining_s = estimated_remaining_s(plan.fraction(since.samples_seen, since.step), since.at, done, where.at)
            if remaining_s is not None:
                status["estimatedRemainingSeconds"] = remaining_s
        values: dict[str, Any] = {"step": where.step, "epoch": min(where.epoch + 1, plan.epochs),
                                  "samples_seen": where.samples_seen}
        with self._lock:
            records = {kind: dict(record) for kind, record in self._records.items()}
        for kind, prefix in (("train", ""), ("test", "eval_")):
            values.update({prefix + name: value for name, value in records.get(kind, {}).items()
                           if name not in LEFT_OUT})
        if resumed_from_step is not None:
            values["resumed_from_step"] = resumed_from_step
        if self.restarts:
            values["restarts"] = self.restarts
        status["metrics"] = [{"name": name[:MAX_TEXT], "value": _text(value)}
                             for name, value in list(values.items())[:MAX_METRICS] if name]
        return status

    def _send(self, status: dict[str, Any]) -> bool:
        """One POST; whether the server took it. Each kind of failure is warned about once."""
        assert self.server is not None
        server = self.server
        try:
            token = Path(server.token_file).read_text().strip()
        except OSError as error:
            self._failed("token", f"gets no token: {server.token_file or '(no file named)'} cannot be read "
                                  f"({error.strerror or error})")
            return False
        try:
            context = ssl.create_default_context(cafile=server.ca_cert_file or None)
        except (OSError, ssl.SSLError) as error:
            self._failed("CA certificate", f"cannot be verified: its CA certificate {server.ca_cert_file} cannot be "
                                           f"used ({getattr(error, 'strerror', None) or error})")
            return False
        stamped = {**status, "lastUpdatedTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
        request = urllib.request.Request(server.url, data=json.dumps({"trainerStatus": stamped}).encode(),
                                         method="POST", headers={"Authorization": f"Bearer {token}",
                                                                 "Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context), _NoRedirects())
        try:
            with opener.open(request, timeout=REQUEST_TIMEOUT_S) as response:
                response.read()
        except urllib.error.HTTPError as error:
            self._refused(error)
            return False
        except (OSError, ValueError) as error:  # URLError, TLS, a timeout, a refused connection; a malformed URL
            reason = error.reason if isinstance(error, urllib.error.URLError) else error
            self._failed("unreachable", f"cannot be reached ({type(reason).__name__}: {reason})")
            return False
        self.reports_taken += 1
        if self._failing:
            self._failing = False
            self.log.info("TrainJob progress: the status server %s takes reports again", redact(server.url))
        return True

    def _refused(self, error: urllib.error.HTTPError) -> None:
        said = _message(error)
        if error.code in (401, 403):
            self._failed("token", f"refused the token in {self.server.token_file if self.server else ''} "
                                  f"(HTTP {error.code} {said})")
        elif 400 <= error.code < 500:  # the request is wrong (this trainer's bug) or names no TrainJob
            self._failed(f"HTTP {error.code}", f"refused the report (HTTP {error.code} {said})")
        else:
            self._failed("unreachable", f"failed (HTTP {error.code} {said})")

    def _failed(self, kind: str, what: str) -> None:
        self._failing = True
        if kind in self._warned:
            return
        self._warned.add(kind)
        self.log.warning("TrainJob progress: the status server %s %s; training goes on, and reports are retried "
                         "quietly", redact(self.server.url if self.server else ""), redact(what))


def estimated_remaining_s(done_then: float, then_s: float, done_now: float, now_s: float) -> int | None:
    """The seconds left at the rate from ``then_s`` to ``now_s`` (evaluations and saves included, as they will be
    again); None until a rate is known."""
    if now_s <= then_s or done_now <= done_then:
        return None
    rate = (done_now - done_then) / (now_s - then_s)
    return min(MAX_SECONDS, round((1 - done_now) / rate))


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """The status server never redirects: a redirect would carry the token elsewhere, so it is a failure."""

    def redirect_request(self, *_: Any, **__: Any) -> None:
        return None


def _message(error: urllib.error.HTTPError) -> str:
    """The server's reason: its Kubernetes Status's message, else the HTTP reason phrase."""
    try:
        said = json.loads(error.read(4096) or b"{}").get("message", "")
    except (OSError, ValueError, AttributeError):
        said = ""
    return str(said or error.reason)[:200]


def _text(value: Any) -> str:
    """A metric's value as the API takes it: a string of 1 to 64 characters."""
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return text[:MAX_TEXT] or "-"
