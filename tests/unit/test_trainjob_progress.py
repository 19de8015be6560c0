"""TrainJob progress (trainer.trainjob_progress) against a status server on loopback over HTTPS, with a CA made for
the test, that checks each request's token and its body against kubeflow-trainer-api's models
(tests/support/trainjob_status_server.py). Any request it refuses, or any failure of its own, fails the test."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.trainjob_status_server import TOKEN, TrainerStatusServer, request_problems
from trainer import trainjob_progress
from trainer.api import run
from trainer.launchers import StatusServer
from trainer.position import TrainingPosition
from trainer.trainjob_progress import Plan, TrainJobProgress, estimated_remaining_s

LOGGER = "test.trainjob-progress"
EVERY_S = 0.01  # the reports' bound in these tests: each waits for what it expects, never for the clock
SMALL_RUN = ["--dataset", "synthetic", "--synthetic-train-size", "64", "--synthetic-test-size", "16",
             "--batch-size", "8", "--epochs", "2", "--log-every", "1", "--progress", "off", "--no-tensorboard",
             "--num-workers", "0"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[TrainerStatusServer]:
    status_server = TrainerStatusServer(tmp_path / "status-server")
    yield status_server
    status_server.close()
    assert not status_server.problems, "\n".join(status_server.problems)


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> logging.Logger:
    caplog.set_level(logging.INFO, logger=LOGGER)
    return logging.getLogger(LOGGER)


def reporter(server: TrainerStatusServer | StatusServer, log: logging.Logger, restarts: int = 0) -> TrainJobProgress:
    where = server if isinstance(server, StatusServer) else StatusServer(server.url, str(server.token_file),
                                                                         str(server.ca_cert_file))
    return TrainJobProgress(where, log, restarts, every_s=EVERY_S)


def metrics(report: dict[str, Any]) -> dict[str, str]:
    return {metric["name"]: metric["value"] for metric in report["metrics"]}


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def train_steps(position: TrainingPosition, steps: int, samples_per_step: int) -> None:
    position.step += steps
    position.samples_seen += steps * samples_per_step


def test_a_run_reports_rising_progress_its_metrics_and_a_final_100(server, log, caplog):
    position, plan = TrainingPosition(), Plan(total_samples=80, epochs=1)
    progress = reporter(server, log)
    with progress.run():
        progress.watch(position, plan, resumed_from_step=None)
        for step in range(1, 10):
            train_steps(position, 1, 8)
            progress.log_metrics("train", {"loss": 1.0 / step, "lr": 0.001, "samples_per_s": 512.0, "epoch": 1,
                                           "samples_seen": position.samples_seen})
            assert server.wait_for(lambda it, s=str(step): any(metrics(r)["step"] == s for r in it.reports)), step
        progress.log_metrics("test", {"loss": 0.25, "accuracy": 0.875, "samples": 16, "epoch": 1,
                                      "samples_seen": 80})
        train_steps(position, 1, 8)  # every sample trained: 99 until the run has ended (its evaluation, its save)
        assert server.wait_for(lambda it: any(metrics(r)["step"] == "10" for r in it.reports))

    shown = [report["progressPercentage"] for report in server.reports]
    assert shown == sorted(shown) and shown[0] == 0 and shown[-2:] == [99, 100], shown
    last = server.reports[-1]
    assert last["estimatedRemainingSeconds"] == 0
    assert any("estimatedRemainingSeconds" in report for report in server.reports[1:-1])  # the measured rate
    assert metrics(last) == {"step": "10", "epoch": "1", "samples_seen": "80", "loss": "0.111111", "lr": "0.001",
                             "samples_per_s": "512", "eval_loss": "0.25", "eval_accuracy": "0.875"}
    assert not progress._thread.is_alive() and not warnings(caplog)


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_unreachable_server_is_one_warning_and_the_training_completes(server, log, caplog):
    nobody = StatusServer(f"https://127.0.0.1:{unused_port()}/apis/trainer.kubeflow.org/v1alpha1/namespaces/a/"
                          f"trainjobs/b/status", str(server.token_file), str(server.ca_cert_file))
    position = TrainingPosition()
    progress = reporter(nobody, log)
    with progress.run():
        progress.watch(position, Plan(64, 1), None)
        train_steps(position, 8, 8)
    # The first report and the last both failed: one warning, and the retry said nothing.
    (warning,) = warnings(caplog)
    assert "cannot be reached" in warning and "training goes on" in warning, warning
    assert progress.reports_taken == 0 and not progress._thread.is_alive()


@pytest.mark.parametrize(("answer", "said"), [(401, "refused the token"), (403, "refused the token"),
                                              (422, "refused the report (HTTP 422"), (500, "failed (HTTP 500")])
def test_a_refusing_server_is_one_warning_that_names_the_answer_and_reports_are_retried_quietly(
        answer, said, server, log, caplog):
    server.answer = answer
    position = TrainingPosition()
    progress = reporter(server, log)
    with progress.run():
        progress.watch(position, Plan(64, 1), None)
        for _ in range(3):  # each a new state, retried once the backoff lets it
            train_steps(position, 1, 8)
        assert server.wait_for(lambda it: len(it.reports) >= 2)
    (warning,) = warnings(caplog)
    assert said in warning and f"HTTP {answer}" in warning, warning
    assert progress.reports_taken == 0 and len(server.reports) >= 3  # the final report was tried too


def test_a_server_that_takes_reports_again_is_said_once(server, log, caplog):
    server.answer = 500
    position = TrainingPosition()
    progress = reporter(server, log)
    with progress.run():
        progress.watch(position, Plan(64, 1), None)
        assert server.wait_for(lambda it: len(it.reports) >= 1)
        server.answer = 200
        train_steps(position, 1, 8)
        assert server.wait_for(lambda it: len(it.reports) >= 2)
    assert len(warnings(caplog)) == 1 and any("takes reports again" in record.getMessage() for record in caplog.records)
    assert server.reports[-1]["progressPercentage"] == 100


def test_a_slow_server_never_holds_the_training_and_only_the_newest_state_waits(server, log, caplog, monkeypatch):
    monkeypatch.setattr(trainjob_progress, "FINAL_REPORT_S", 0.1)
    server.release.clear()  # each request is held until the test lets it go
    position = TrainingPosition()
    progress = reporter(server, log)
    progress.watch(position, Plan(8000, 1), None)
    assert server.held.wait(30)
    for step in range(1000):  # the training goes on while the server holds the first report
        train_steps(position, 1, 8)
        progress.log_metrics("train", {"loss": float(step)})
    # Still the first request, not given up on (that would be a warning and a second request): the training did not
    # wait for it.
    assert server.held.is_set() and server.requests == 1 and not warnings(caplog)
    progress.close(finished=True)  # the exit does not wait for a server that holds a report
    assert server.held.is_set() and progress._thread.is_alive()
    assert any("did not take the last report in time" in record.getMessage() for record in caplog.records)
    server.release.set()
    assert server.wait_for(lambda it: bool(it.reports) and it.reports[-1]["progressPercentage"] == 100)
    # 1,000 states, and only the one in flight and the newest were sent: nothing queued behind the slow server.
    assert len(server.reports) <= 3, [metrics(report)["step"] for report in server.reports]
    assert metrics(server.reports[-1])["step"] == "1000" and metrics(server.reports[-1])["loss"] == "999"
    progress._thread.join(30)
    assert not progress._thread.is_alive()


def test_a_failure_of_the_reporting_itself_is_one_warning_and_never_reaches_the_training(server, log, caplog,
                                                                                           monkeypatch):
    def broken(value: Any) -> str:
        raise TypeError(f"cannot show {value!r}")

    monkeypatch.setattr(trainjob_progress, "_text", broken)
    position = TrainingPosition()
    progress = reporter(server, log)
    with progress.run():
        progress.watch(position, Plan(64, 1), None)
        train_steps(position, 8, 8)
    (warning,) = warnings(caplog)
    assert "reporting stopped (TypeError: cannot show 0)" in warning and not server.reports


def test_the_time_remaining_is_at_the_rate_measured_since_the_first_step():
    assert estimated_remaining_s(0.1, 100.0, 0.2, 110.0) == 80  # 10% in 10 s: 80% in 80 s
    assert estimated_remaining_s(0.1, 100.0, 0.1, 110.0) is None  # no progress yet: no rate
    assert estimated_remaining_s(0.0, 0.0, 1e-12, 1e6) == 2**31 - 1  # an int32, as the API has it


def test_progress_counts_samples_so_a_resize_keeps_it_and_max_steps_ends_it_first():
    plan = Plan(total_samples=1000, epochs=2)
    # 250 samples: 31 steps of 8 on one rank, or 8 steps of 32 on four (elastic): the same progress.
    assert plan.fraction(250, 31) == plan.fraction(250, 8) == 0.25
    assert Plan(1000, 2, max_steps=20).fraction(250, 10) == 0.5  # --max-steps 20 ends the run first
    assert Plan(1000, 2, max_steps=1000).fraction(250, 10) == 0.25


def test_a_resumed_process_names_the_checkpoint_it_went_back_to(server, log, caplog):
    position = TrainingPosition(epoch=0, step=6, samples_in_epoch=48, samples_seen=48)  # the checkpoint's
    progress = reporter(server, log, restarts=2)
    with progress.run():
        progress.watch(position, Plan(80, 1), resumed_from_step=6)
        assert server.wait_for(lambda it: len(it.reports) >= 1)
    first = server.reports[0]
    assert first["progressPercentage"] == 60
    assert metrics(first)["resumed_from_step"] == "6" and metrics(first)["restarts"] == "2"


def test_the_trainer_resumed_from_a_checkpoint_reports_from_its_step_and_says_so(server, tmp_path, monkeypatch,
                                                                                capsys):
    for name, value in server.environment().items():
        monkeypatch.setenv(name, value)
    out = ["--output-dir", str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "checkpoints")]

    assert run(argv=[*SMALL_RUN, *out, "--max-steps", "2"]) == 0  # stops at step 2, with its checkpoint
    first_run = list(server.reports)
    assert first_run[0]["progressPercentage"] == 0 and "resumed_from_step" not in metrics(first_run[0])
    assert first_run[-1]["progressPercentage"] == 100 and metrics(first_run[-1])["step"] == "2"
    assert "loss" in metrics(first_run[-1]) and "eval_loss" in metrics(first_run[-1])

    assert run(argv=[*SMALL_RUN, *out]) == 0  # the whole 2 epochs: 16 steps of 8 samples
    resumed = server.reports[len(first_run):]
    # 2 steps of 16 done: 16 of 128 samples, and the checkpoint named as the reason for the lower figure.
    assert resumed[0]["progressPercentage"] == 12 and metrics(resumed[0])["resumed_from_step"] == "2"
    assert metrics(resumed[0])["step"] == "2"
    assert resumed[-1]["progressPercentage"] == 100 and metrics(resumed[-1])["step"] == "16"
    assert [report["progressPercentage"] for report in resumed] == sorted(r["progressPercentage"] for r in resumed)
    assert "TrainJob progress" not in capsys.readouterr().err


def test_the_trainer_completes_with_an_unreachable_server_and_warns_once(server, tmp_path, monkeypatch, capsys):
    environment = {**server.environment(), "KUBEFLOW_TRAINER_SERVER_URL": f"https://127.0.0.1:{unused_port()}/x"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert run(argv=[*SMALL_RUN, "--output-dir", str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "c")]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "TrainJob progress" in line]
    assert len(said) == 1 and "cannot be reached" in said[0], said


def test_the_test_server_refuses_what_the_api_refuses():
    good = {"trainerStatus": {"progressPercentage": 45, "estimatedRemainingSeconds": 795649,
                              "metrics": [{"name": "loss", "value": "0.2347"}],
                              "lastUpdatedTime": "2025-01-23T10:30:45Z"}}
    assert request_problems(good) == []
    status = good["trainerStatus"]
    for wrong in ({**good, "extra": 1}, {"trainerStatus": {**status, "progress": 45}},
                  {"trainerStatus": {**status, "progressPercentage": "45"}},
                  {"trainerStatus": {**status, "progressPercentage": 101}},
                  {"trainerStatus": {**status, "progressPercentage": 4.5}},
                  {"trainerStatus": {**status, "estimatedRemainingSeconds": -1}},
                  {"trainerStatus": {key: value for key, value in status.items() if key != "lastUpdatedTime"}},
                  {"trainerStatus": {**status, "metrics": [{"name": "loss", "value": 0.2347}]}},
                  {"trainerStatus": {**status, "metrics": [{"name": "loss", "value": "0" * 65}]}},
                  {"trainerStatus": {**status, "metrics": [{"name": "loss", "value": "1", "unit": "x"}]}}):
        assert request_problems(wrong), wrong


def test_the_token_is_read_from_its_file_at_each_report_as_the_kubelet_renews_it(server, log, caplog):
    server.token_file.write_text("an-expired-token")
    server.wrong_tokens_expected = True
    position = TrainingPosition()
    progress = reporter(server, log)
    progress.watch(position, Plan(64, 1), None)
    assert server.wait_for(lambda it: it.requests >= 1) and not server.reports
    server.token_file.write_text(TOKEN)
    train_steps(position, 1, 8)
    progress.close(finished=True)
    assert server.wait_for(lambda it: bool(it.reports) and it.reports[-1]["progressPercentage"] == 100)
    (warning,) = warnings(caplog)
    assert "refused the token" in warning


def test_without_a_status_server_nothing_is_started(log):
    progress = TrainJobProgress(None, log)  # every rank but 0, and any process outside a TrainJob
    with progress.run():
        progress.watch(TrainingPosition(), Plan(64, 1), None)
        progress.log_metrics("train", {"loss": 1.0})
    assert progress._thread is None
