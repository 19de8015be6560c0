"""--tracker mlflow,wandb against the real things: an MLflow tracking server (SQLite, artifacts through the
server) on loopback, read back with MLflow's client; W&B offline, read back with W&B's own `wandb leet inspect`.

One 2-rank run with both trackers is stopped (--max-steps) and resumed: each tracker shows one run with every
step's metrics once. Credentials given the usual ways (a token in MLflow's environment, a password in the URI, a
W&B key) reach none of the run's files, logs, checkpoints or tracker records."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.processes import BIN_DIR, REPO_ROOT, clean_env, free_port, run, torchrun
from tests.support.checkpoint_reading import every_file_under, summary
from tests.support.mlflow_server import MlflowServer, mlflow_server
from trainer.config import TrackingConfig
from trainer.errors import Preempted
from trainer.tracking import Tracking

SECRETS = {"MLFLOW_TRACKING_TOKEN": "token-never-written-1", "WANDB_API_KEY": "wandb-key-never-written-2"}
PASSWORD = "password-never-written-3"
# 2 ranks x 8 samples: 6 steps an epoch, 12 in all; the first run stops at step 5, mid-epoch.
ARGS = ["--dataset", "synthetic", "--synthetic-train-size", "96", "--synthetic-test-size", "32", "--batch-size", "8",
        "--epochs", "2", "--log-every", "1", "--checkpoint-every", "2", "--progress", "off", "--no-tensorboard"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> MlflowServer:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as started:
        yield started


def records(output_dir: Path, kind: str) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == kind]


def wandb_records(output_dir: Path) -> list[dict]:
    """Every record of every offline W&B run folder, in order, through W&B's own reader."""
    found = []
    for folder in sorted((output_dir / "wandb").glob("offline-run-*")):
        shown = subprocess.run([str(BIN_DIR / "wandb"), "leet", "inspect", "--json", str(folder)], env=clean_env(),
                               capture_output=True, text=True, timeout=120, check=True)
        found.append([json.loads(line) for line in shown.stdout.splitlines() if line.strip()])
    return found


def test_a_stopped_and_resumed_two_rank_run_is_one_run_in_mlflow_and_in_wandb(server, tmp_path):
    uri = server.uri.replace("http://", f"http://alice:{PASSWORD}@")
    args = [*ARGS, "--output-dir", str(tmp_path), "--tracker", "mlflow,wandb", "--tracking-uri", uri,
            "--experiment", "trackers-test", "--tracker-checkpoints"]
    env = {**SECRETS, "WANDB_MODE": "offline"}
    stopped = torchrun([*args, "--max-steps", "5"], nproc=2, env=env)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = torchrun([*args, "--lr", "0.002", "--allow-resume-change", "lr"], nproc=2, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(tmp_path)["resumed_from"].endswith("step-00000005")
    assert [record["step"] for record in records(tmp_path, "train")] == list(range(1, 13))

    # MLflow: one run, both segments' steps once each, the config, the summary, the files.
    client = server.client()
    experiment = client.get_experiment_by_name("trackers-test")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.status == "FINISHED" and found.info.run_name == tmp_path.name
    run_id = found.info.run_id
    assert f"tracker mlflow: started run {run_id}" in stopped.stderr
    assert f"tracker mlflow: continues run {run_id}" in resumed.stderr
    jsonl = {record["step"]: record for record in records(tmp_path, "train")}
    history = client.get_metric_history(run_id, "train/loss")
    assert [point.step for point in history] == list(range(1, 13))
    assert all(point.value == pytest.approx(jsonl[point.step]["loss"], rel=1e-12) for point in history)
    assert [point.step for point in client.get_metric_history(run_id, "test/accuracy")] == [5, 6, 12]
    params = found.data.params
    assert params["task.name"] == "classification" and params["train.batch_size"] == "8"
    assert params["optim.lr"] == "0.001"  # the first segment's: MLflow's parameters never change
    assert found.data.tags["ddp-deploy.resume-changes"] == (
        "optim.lr 0.001 -> 0.002; train.max_steps 5 -> 0; checkpoint.allow_resume_change '' -> lr")
    assert params["tracking.tracking_uri"] == server.uri.replace("http://", "http://alice:***@")
    assert found.data.metrics["final/global_step"] == 12
    assert found.data.metrics["final/test_accuracy"] == summary(tmp_path)["test_accuracy"]
    assert {item.path for item in client.list_artifacts(run_id)} == {"checkpoints", "config.yaml", "summary.json"}
    uploaded = {item.path for item in client.list_artifacts(run_id, "checkpoints/step-00000012")}
    assert {"checkpoints/step-00000012/manifest.json", "checkpoints/step-00000012/state.pt"} <= uploaded

    # W&B offline: two folders (one per segment) of one run id; the steps once each, in order.
    segments = wandb_records(tmp_path)
    assert len(segments) == 2
    ids = {record["run"]["run_id"] for segment in segments for record in segment if record["type"] == "run"}
    (ids_seen,) = ids
    assert f"tracker wandb: continues run {ids_seen}" in resumed.stderr
    steps = [record["history"]["item"]["trainer/step"] for segment in segments for record in segment
             if record["type"] == "history" and "train/loss" in record["history"]["item"]]
    assert steps == list(range(1, 13))
    rows = [[record["history"]["item"]["_step"] for record in segment if record["type"] == "history"]
            for segment in segments]
    assert rows[0][0] == rows[1][0] == 0, "offline, W&B's own counter starts again in each segment"
    dry_run = subprocess.run([str(BIN_DIR / "wandb"), "sync", "--dry-run",
                              *map(str, sorted((tmp_path / "wandb").glob("offline-run-*")))],
                             env=clean_env({"WANDB_API_KEY": "x" * 40}), capture_output=True, text=True, timeout=120)
    assert dry_run.returncode == 0 and dry_run.stderr.count(f"run-{ids_seen}.wandb") == 2, dry_run.stderr[-2000:]
    configs = [[record["config"]["update"] for record in segment if record["type"] == "config"] for segment in segments]
    assert configs[0][0]["optim"]["lr"] == 0.001 and configs[0][0]["task"]["name"] == "classification"
    assert configs[1][0]["optim"]["lr"] == 0.002  # W&B's config follows the resume's change
    exits = [record["exit"]["exit_code"] for segment in segments for record in segment if record["type"] == "exit"]
    assert exits == [0, 0]
    final = [record["summary"]["update"] for record in segments[1] if record["type"] == "summary"]
    assert any(update.get("final/global_step") == 12 for update in final)

    # No credential anywhere: logs, config.yaml, metrics, checkpoints, W&B's files, MLflow's records.
    written = every_file_under(tmp_path, server.folder / "artifacts")
    shown = [stopped.stdout, stopped.stderr, resumed.stdout, resumed.stderr, json.dumps(params),
             json.dumps(found.data.tags)]
    for secret in [*SECRETS.values(), PASSWORD]:
        assert not [name for name, data in written.items() if secret.encode() in data], secret
        assert not [text for text in shown if secret in text], secret


def test_a_preempted_run_is_killed_in_mlflow_until_its_resume_continues_it(server, tmp_path):
    """The statuses a requeued job's MLflow run goes through, with the trainer's Tracking in this process."""
    log = logging.getLogger("test-trackers")
    config = TrackingConfig(tracker="mlflow", tracking_uri=server.uri, experiment="preempted")
    first = Tracking(config, tmp_path, enabled=True, log=log)
    with pytest.raises(Preempted), first.run():
        first.start({"optim": {"lr": 0.1}})
        first.log_metrics("train", 1, {"loss": 0.5})
        raise Preempted("preempted at step 1; checkpoint written")
    (run_id,) = first.run_ids.values()
    client = server.client()
    assert client.get_run(run_id).info.status == "KILLED"
    requeued = Tracking(config, tmp_path, enabled=True, log=log)
    requeued.state_part().restore(first.state_part().capture(), None)  # type: ignore[arg-type]  # the checkpoint
    with requeued.run():
        requeued.start({"optim": {"lr": 0.1}})
        assert requeued.run_ids == {"mlflow": run_id}
        assert client.get_run(run_id).info.status == "RUNNING"
        requeued.log_metrics("train", 2, {"loss": 0.25})
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [(point.step, point.value) for point in client.get_metric_history(run_id, "train/loss")] == [
        (1, 0.5), (2, 0.25)]


def test_a_fork_starts_its_own_run_and_a_deleted_run_is_replaced_not_fatal(server, tmp_path, caplog):
    """A checkpoint resumed in another output folder (a fine-tune, a sweep) starts a new run that names the one
    it came from; one whose MLflow run was deleted starts a new run with a warning, not exit 2 on every resume."""
    log = logging.getLogger("test-trackers")
    config = TrackingConfig(tracker="mlflow", tracking_uri=server.uri, experiment="forks")
    parent = Tracking(config, tmp_path / "parent", enabled=True, log=log)
    with parent.run():
        parent.start({"optim": {"lr": 0.1}})
        parent.log_metrics("train", 1, {"loss": 0.5})
    saved = parent.state_part().capture()
    client = server.client()

    def resumed(folder: Path) -> Tracking:
        tracking = Tracking(config, folder, enabled=True, log=log)
        tracking.state_part().restore(saved, None)  # type: ignore[misc, arg-type]
        with tracking.run():
            tracking.start({"optim": {"lr": 0.1}})
        return tracking

    fork = resumed(tmp_path / "fine-tune")
    (parent_id,), (fork_id,) = parent.run_ids.values(), fork.run_ids.values()
    assert fork_id != parent_id and client.get_run(fork_id).data.tags["ddp-deploy.forked-from"] == parent_id
    assert [point.step for point in client.get_metric_history(parent_id, "train/loss")] == [1]  # untouched
    # A fork keeps no other tracker's run of its parent either: a later --tracker of that kind starts anew.
    bare = Tracking(TrackingConfig(), tmp_path / "no-tracker", enabled=True, log=log)
    bare.state_part().restore({**saved, "runs": {**saved["runs"], "wandb": "parent-wandb-run"}}, None)  # type: ignore[arg-type]
    assert bare.state_part().capture()["runs"] == {}
    assert resumed(tmp_path / "parent").run_ids == {"mlflow": parent_id}  # the same folder continues it
    client.delete_run(parent_id)
    replaced = resumed(tmp_path / "parent")
    assert replaced.run_ids["mlflow"] != parent_id
    assert f"the checkpoint's run {parent_id} was deleted on" in caplog.text


def test_a_preempted_runs_trackers_end_within_the_grace_period_when_the_server_hangs(server, tmp_path, caplog):
    """The grace period bounds the whole exit, the trackers' last calls included (--tracker-timeout-s 60 would
    outlast any launcher's kill window); what did not go out is one warning."""
    config = TrackingConfig(tracker="mlflow", tracking_uri=server.uri, experiment="hung", tracker_timeout_s=60)
    tracking = Tracking(config, tmp_path, enabled=True, log=logging.getLogger("test-trackers"))
    tracking.start({"optim": {"lr": 0.1}})
    with server.hung():
        stopped_at = time.monotonic()
        with pytest.raises(Preempted), tracking.run(end_by=lambda: stopped_at + 3):
            tracking.log_metrics("train", 1, {"loss": 0.5})
            raise Preempted("preempted at step 1; checkpoint written")
        took = time.monotonic() - stopped_at
    assert 2.5 < took < 6, took
    warnings = [record.getMessage() for record in caplog.records
                if record.name == "test-trackers" and record.levelno == logging.WARNING]
    assert len(warnings) == 1 and re.fullmatch(
        r"tracker mlflow did not take its last \d call\(s\) within the grace period after the stop signal "
        r"\(--grace-period-s\); metrics.jsonl has every record", warnings[0]), warnings


def test_a_server_that_dies_mid_run_is_one_warning_and_the_run_completes(tmp_path):
    """The run stops at a gate in its fourth step while the server is killed, then goes on: MLflow's client
    either fails at once (MLFLOW_HTTP_REQUEST_MAX_RETRIES=0) or retries for minutes (its default) in the
    tracker's thread, never in training's; the run ends with exit 0 and every record in metrics.jsonl."""
    for retries, expected in (("0", "tracker mlflow failed while logging step"),
                              ("", "tracker mlflow did not take its last")):
        output, gate = tmp_path / f"run{retries}", tmp_path / f"gate{retries}"
        gate.mkdir()
        with mlflow_server(tmp_path / f"server{retries}") as doomed:
            env = clean_env({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": retries} if retries else {})
            process = subprocess.Popen(
                [sys.executable, "-m", "trainer", "--task", "tests.support.tasks:GatedTask", "--gate", str(gate),
                 "--batch-size", "8", "--epochs", "2", "--log-every", "1", "--progress", "off", "--no-tensorboard",
                 "--output-dir", str(output), "--tracker", "mlflow", "--tracking-uri", doomed.uri,
                 "--tracker-timeout-s", "5"],
                env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
            try:
                _wait_for(gate / "reached", process)
                doomed.kill()
                (gate / "go").touch()
                _, stderr = process.communicate(timeout=240)
            finally:
                if process.poll() is None:
                    process.kill()
        assert process.returncode == 0, stderr[-3000:]
        warnings = [line for line in stderr.splitlines() if "WARNING tracker mlflow" in line]
        assert len(warnings) == 1 and expected in warnings[0], stderr[-3000:]
        assert "Retrying" not in stderr and "Traceback" not in stderr, stderr[-3000:]  # nor a library's warnings
        assert [record["step"] for record in records(output, "train")] == list(range(1, 17))


def test_a_crash_after_the_newest_checkpoint_is_recorded_as_a_rollback_in_the_same_run(server, tmp_path):
    """SIGKILL at a gate mid-run, after some steps were logged past the newest checkpoint; the relaunch continues
    the same MLflow run from that checkpoint, logs those steps again, and the run says where it went back."""
    output, gate = tmp_path / "run", tmp_path / "gate"
    gate.mkdir()
    common = [sys.executable, "-m", "trainer", "--task", "tests.support.tasks:GatedTask", "--batch-size", "8",
              "--epochs", "1", "--log-every", "1", "--checkpoint-every", "2", "--progress", "off", "--no-tensorboard",
              "--output-dir", str(output), "--tracker", "mlflow", "--tracking-uri", server.uri, "--experiment",
              "rollbacks", "--job-id", "rollbacks"]
    # The gate at the 6th loss call: steps 1-3 logged, the newest checkpoint at step 2.
    process = subprocess.Popen([*common, "--gate", str(gate), "--gate-at", "6"], env=clean_env(), cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(gate / "reached", process)
        logged = [record["step"] for record in records(output, "train")]
        client = server.client()
        deadline = time.monotonic() + 60
        while True:  # the tracker's thread has sent what metrics.jsonl holds: the crash loses none of it
            runs = client.search_runs([client.get_experiment_by_name("rollbacks").experiment_id])
            sent = [point.step for point in client.get_metric_history(runs[0].info.run_id, "train/loss")] if runs \
                else []
            if sent and max(sent) == logged[-1]:
                break
            assert time.monotonic() < deadline, f"MLflow has steps {sent}, metrics.jsonl {logged}"
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGKILL)  # a crash: no checkpoint at the stop, nothing released
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    saved = sorted(int(path.name.split("-")[1]) for path in (output / "checkpoints").glob("step-*"))
    assert saved and logged and logged[-1] > saved[-1], (logged, saved)  # steps logged past the checkpoint
    resumed = run([*common], env=clean_env(), timeout_s=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (found,) = client.search_runs([client.get_experiment_by_name("rollbacks").experiment_id])
    assert found.data.tags["ddp-deploy.rollbacks"] == f"resumed at step {saved[-1]} after step {logged[-1]} was logged"
    history = [point.step for point in client.get_metric_history(found.info.run_id, "train/loss")]
    again = list(range(saved[-1] + 1, logged[-1] + 1))
    assert sorted(history) == sorted([*range(1, max(history) + 1), *again]), history  # both values of those steps
    assert f"logs steps {saved[-1] + 1}-{logged[-1]} again" in resumed.stderr


def _wait_for(path: Path, process: subprocess.Popen) -> None:
    import time

    deadline = time.monotonic() + 180
    while not path.exists():
        assert process.poll() is None, f"the run ended before its gate: {process.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "the run did not reach its gate in 180 s"
        time.sleep(0.05)


def test_unreachable_or_missing_trackers_are_one_line_before_training(server, tmp_path):
    base = [sys.executable, "-m", "trainer", *ARGS, "--max-steps", "1", "--output-dir", str(tmp_path)]
    port = free_port()
    refused = run([*base, "--tracker", "mlflow", "--tracking-uri", f"http://127.0.0.1:{port}"])
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        f"[rank 0] error: --tracker mlflow: cannot reach the tracking server http://127.0.0.1:{port} (Connection "
        f"refused); start it, or fix --tracking-uri or MLFLOW_TRACKING_URI"), refused.stderr[-2000:]
    # 127.1 is 127.0.0.1 to the resolver, but not a Host header MLflow's DNS-rebinding guard lets through (403).
    guarded = server.uri.replace("127.0.0.1", "127.1")
    refused_host = run([*base, "--tracker", "mlflow", "--tracking-uri", guarded])
    assert refused_host.returncode == 2
    host = guarded.removeprefix("http://")
    assert refused_host.stderr.strip().splitlines()[-1] == (
        f"[rank 0] error: --tracker mlflow: the server at {guarded} refuses the host name {host} (MLflow's guard "
        f"against DNS rebinding allows localhost and private IPs only); start it with --allowed-hosts {host}, or "
        f"reach it by a private IP"), refused_host.stderr[-2000:]
    nowhere = run([*base, "--tracker", "mlflow"], env={"MLFLOW_TRACKING_URI": ""})
    assert nowhere.returncode == 2
    assert nowhere.stderr.strip().splitlines()[-1].startswith(
        "[rank 0] error: --tracker mlflow needs a tracking server: pass --tracking-uri or set MLFLOW_TRACKING_URI")
    # A machine without the extra: the library's import fails, the line says what to install.
    shadow = tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'wandb'\")\n")
    missing = run([*base, "--tracker", "wandb"], env={"PYTHONPATH": f"{shadow.parent}:{REPO_ROOT}"})
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == (
        "[rank 0] error: --tracker wandb needs its client library (No module named 'wandb'); install it with pip "
        "install 'ddp-deploy[wandb]'"), missing.stderr[-2000:]
    assert not list(tmp_path.glob("checkpoints/step-*")), "a run whose tracker failed at start trained"
