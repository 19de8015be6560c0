"""--tracker mlflow: an MLflow tracking server (or any MLflow tracking URI), through MLflow's own client.

The client is MlflowClient, not MLflow's module-level API, whose active run is process-wide state. The server
is --tracking-uri, else MLFLOW_TRACKING_URI; credentials stay in MLflow's own environment variables
(MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME and _PASSWORD), which nothing here reads or writes.

Mapping: the config and task are the run's parameters (``optim.lr``), each metrics record its metrics at the
optimizer step (``train/loss``, ``test/accuracy``), summary.json's numbers ``final/<name>``, config.yaml and
summary.json artifacts, and --tracker-checkpoints the newest checkpoint under ``checkpoints/<name>``.
A resume continues the checkpoint's run: its status goes back to RUNNING, and a setting the resume changed
(MLflow's parameters cannot change) is kept as the tag ``ddp-deploy.resume-changes``.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.errors import TrackerError
from trainer.redact import redact
from trainer.seams import TRACKERS
from trainer.tracking import CheckpointFiles, Tracker, TrackerRun, flat_params

ROLLBACK_TAG = "ddp-deploy.rollbacks"
DEFAULT_EXPERIMENT = "ddp-deploy"
# MLflow's limits: a batch holds at most 1000 metrics and 100 parameters.
METRICS_PER_BATCH, PARAMS_PER_BATCH = 1000, 100


class MlflowTracker(Tracker):
    def __init__(self) -> None:
        self.uri = ""
        self.client: Any = None
        self.run_id = ""
        self.experiment_id = ""

    def describe(self) -> str:
        if self.run_id and urllib.parse.urlsplit(self.uri).scheme in ("http", "https"):
            return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return self.uri

    def load(self) -> None:
        from mlflow import MlflowClient  # noqa: F401 - imported late: an extra (pip install 'ddp-deploy[mlflow]')

    def start(self, run: TrackerRun, log: logging.Logger) -> str:
        self.uri = run.settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if not self.uri:
            raise TrackerError("--tracker mlflow needs a tracking server: pass --tracking-uri or set "
                               "MLFLOW_TRACKING_URI (http://host:5000, or a local mlruns folder's file:// URL)")
        _check_reachable(self.uri, run.settings.tracker_timeout_s)
        from mlflow import MlflowClient  # loaded by load()

        # MLflow's client prints the run's address at its end, credentials of the URI included; start() logs it
        # redacted instead (trainer.tracking).
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        self.client = MlflowClient(self.uri)
        try:
            return self._start(run, log)
        except Exception as error:
            if "Invalid Host header" not in str(error):
                raise
            host = urllib.parse.urlsplit(self.uri).netloc.rpartition("@")[2]
            raise TrackerError(redact(
                f"--tracker mlflow: the server at {self.uri} refuses the host name {host} (MLflow's guard against "
                f"DNS rebinding allows localhost and private IPs only); start it with --allowed-hosts {host}, or "
                f"reach it by a private IP")) from None

    def _start(self, run: TrackerRun, log: logging.Logger) -> str:
        experiment = run.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        params = flat_params(run.params)
        if run.resume_id and self._continue(run.resume_id, params, log, run.resumed_at_step):
            return self.run_id
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        tags = {"ddp-deploy.output_dir": str(run.output_dir)}
        if run.forked_from:
            tags["ddp-deploy.forked-from"] = run.forked_from
        self.run_id = self.client.create_run(self.experiment_id, run_name=run.name, tags=tags).info.run_id
        self._log_params(params)
        return self.run_id

    def _continue(self, run_id: str, params: dict[str, str], log: logging.Logger,
                  resumed_at_step: int | None = None) -> bool:
        """Continue the checkpoint's run; False (a new run) when this server does not have it."""
        from mlflow.exceptions import MlflowException

        try:
            saved = self.client.get_run(run_id)
        except MlflowException as error:
            if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            log.warning("tracker mlflow: the checkpoint's run %s is not on %s; starting a new run", run_id,
                        redact(self.uri))
            return False
        if saved.info.lifecycle_stage != "active":
            # Deleted (and not yet purged): MLflow refuses to change it. A new run, not a job that never resumes.
            log.warning("tracker mlflow: the checkpoint's run %s was deleted on %s; starting a new run", run_id,
                        redact(self.uri))
            return False
        self.run_id, self.experiment_id = run_id, saved.info.experiment_id
        self.client.update_run(run_id, status="RUNNING")
        known = saved.data.params
        changed = [f"{key} {known[key] or repr('')} -> {value or repr('')}" for key, value in params.items()
                   if key in known and known[key] != value]
        self._log_params({key: value for key, value in params.items() if key not in known})
        if changed:
            self.client.set_tag(run_id, "ddp-deploy.resume-changes", "; ".join(changed))
        if resumed_at_step is not None:
            self._record_rollback(saved, resumed_at_step, log)
        return True

    def _record_rollback(self, saved: Any, step: int, log: logging.Logger) -> None:
        """A run that crashed after its newest checkpoint logged steps this resume logs again. MLflow keeps every
        value (it has no way to take one back): the run says where it went back, in its tag
        ``ddp-deploy.rollbacks``, and the values logged after the rollback are the later ones of each step."""
        logged = max((point.step for point in self.client.get_metric_history(self.run_id, "train/loss")),
                     default=0)
        if logged <= step:
            return
        earlier = saved.data.tags.get(ROLLBACK_TAG, "")
        said = f"resumed at step {step} after step {logged} was logged"
        self.client.set_tag(self.run_id, ROLLBACK_TAG, f"{earlier}; {said}" if earlier else said)
        log.warning("tracker mlflow: run %s had logged steps up to %d; this resume from the checkpoint of step %d "
                    "logs steps %d-%d again (MLflow keeps both values; tag %s)", self.run_id, logged, step, step + 1,
                    logged, ROLLBACK_TAG)

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value) for key, value in params.items()]
        for first in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[first:first + PARAMS_PER_BATCH])

    def log_metrics(self, kind: str, step: int, values: Mapping[str, float], made_at: float) -> None:
        self._log_numbers(kind, step, values, made_at)

    def _log_numbers(self, prefix: str, step: int, values: Mapping[str, float], made_at: float | None = None) -> None:
        from mlflow.entities import Metric

        when = int((time.time() if made_at is None else made_at) * 1000)
        metrics = [Metric(f"{prefix}/{key}", float(value), when, step) for key, value in values.items()]
        for first in range(0, len(metrics), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[first:first + METRICS_PER_BATCH])

    def log_summary(self, summary: Mapping[str, float], files: tuple[Path, ...]) -> None:
        self._log_numbers("final", int(summary.get("global_step", 0)), summary)
        for path in files:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))

    def log_checkpoint(self, checkpoint: CheckpointFiles) -> None:
        with tempfile.TemporaryDirectory(prefix="ddp-mlflow-") as folder:
            for filename in checkpoint.files:  # one file in memory at a time
                Path(folder, filename).write_bytes(checkpoint.read(filename))
            self.client.log_artifacts(self.run_id, folder, f"checkpoints/{checkpoint.name}")

    def end(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


def _check_reachable(uri: str, timeout_s: float) -> None:
    """A server that refuses connections fails now, in one line: MLflow's client would retry it for minutes.
    Through the proxy that HTTP(S)_PROXY names for it (and NO_PROXY does not exempt), as MLflow's client goes:
    the server itself may be out of this host's direct reach."""
    parsed = urllib.parse.urlsplit(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return
    host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parsed.scheme) or proxies.get("all")  # ALL_PROXY too, as requests reads it
    via = ""
    if proxy and not urllib.request.proxy_bypass(host):
        proxy = proxy if "://" in proxy else f"http://{proxy}"  # requests takes "user:pass@host:port" as http
        proxied = urllib.parse.urlsplit(proxy)
        if proxied.hostname:
            host, port = proxied.hostname, proxied.port or (443 if proxied.scheme == "https" else 80)
            named = parsed.scheme.upper() if proxies.get(parsed.scheme) else "ALL"
            via = f" through the proxy {proxy} ({named}_PROXY)"
    try:
        socket.create_connection((host, port), timeout=min(timeout_s, 10.0)).close()
    except OSError as error:
        raise TrackerError(redact(f"--tracker mlflow: cannot reach the tracking server {uri}{via} "
                                  f"({error.strerror or error}); start it, or fix --tracking-uri or "
                                  f"MLFLOW_TRACKING_URI{' or the proxy' if via else ''}")) from None


TRACKERS.add("mlflow", MlflowTracker, "an MLflow tracking server (--tracking-uri or MLFLOW_TRACKING_URI)")
