"""The Prometheus endpoint (trainer.prometheus): what a rank exports, its node's ranks served from local rank 0 on
real sockets on loopback, read back with prometheus_client's parsers, and the one-line errors of a port it cannot
have. The 2-rank run that is scraped while it trains is tests/integration/test_prometheus.py."""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from typing import Any

import promql_parser
import pytest

from devtools.processes import REPO_ROOT
from tests.support.prometheus_scrape import consecutive_free_ports, scrape
from trainer.config import OutputConfig
from trainer.errors import ConfigError
from trainer.launchers import DistIdentity
from trainer.position import TrainingPosition
from trainer.prometheus import ALL_ADDRESSES, MetricsEndpoint
from trainer.slow_rank import PartTimes, RankComparison

JOB = "pytorchjob/team/ddp-train"
LOG = logging.getLogger("tests.prometheus")


def identity(rank: int = 0, local_rank: int = 0, world_size: int = 1, local_world_size: int = 1,
             restart_count: int = 0) -> DistIdentity:
    return DistIdentity(rank, local_rank, world_size, local_world_size, rank // local_world_size,
                        world_size // local_world_size, "127.0.0.1", 29500, "torchrun", "node-a", restart_count,
                        job=JOB)


def endpoint(port: int = 0, **who: int) -> MetricsEndpoint:
    return MetricsEndpoint(OutputConfig(metrics_port=port, metrics_host="127.0.0.1"), identity(**who))


def value(metrics: MetricsEndpoint, name: str, rank: int = 0, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"job_id": JOB, "rank": str(rank), **labels})


def listens_again(port: int) -> None:
    """Closed, the endpoint left its port to the next run in this process (Ray Train's workers run one after
    another)."""
    again = endpoint(port)
    again.start()
    again.close()


def test_a_rank_exports_where_training_stands_its_records_and_its_checkpoints():
    metrics = endpoint(rank=1, world_size=4, local_world_size=2, local_rank=1, restart_count=2)
    before = time.time()
    metrics.stepped(TrainingPosition(epoch=1, step=7, samples_seen=224))
    metrics.record("train", {"loss": 0.5, "accuracy": 0.75, "lr": 0.01, "samples_per_s": 880.0, "epoch": 2,
                             "samples_seen": 224})
    metrics.record("test", {"loss": 0.625, "accuracy": 0.7, "samples": 16, "epoch": 2, "samples_seen": 224})
    metrics.record("slow_rank", {"rank": 3, "slow": 1, "data_ratio": 2.0})  # the log's kind: not a gauge here
    metrics.step_time(0.125)
    metrics.checkpoint_saved(0.25)
    metrics.checkpoint_committed(6, 1_700_000_100.0, write_s=1.5)

    assert value(metrics, "ddp_step", 1) == 7 and value(metrics, "ddp_epoch", 1) == 1
    assert value(metrics, "ddp_samples_seen", 1) == 224
    assert before <= value(metrics, "ddp_last_step_timestamp_seconds", 1) <= time.time()
    assert value(metrics, "ddp_train_loss", 1) == 0.5 and value(metrics, "ddp_eval_loss", 1) == 0.625
    assert value(metrics, "ddp_train_metric", 1, metric="accuracy") == 0.75
    assert value(metrics, "ddp_eval_metric", 1, metric="accuracy") == 0.7
    assert value(metrics, "ddp_eval_metric", 1, metric="samples") is None  # what evaluation counted, not a metric
    assert value(metrics, "ddp_learning_rate", 1) == 0.01 and value(metrics, "ddp_samples_per_second", 1) == 880
    assert value(metrics, "ddp_step_seconds", 1) == 0.125
    assert value(metrics, "ddp_train_metric", 1, metric="slow") is None
    assert value(metrics, "ddp_world_size", 1) == 4 and value(metrics, "ddp_restarts", 1) == 2
    assert value(metrics, "ddp_rank_info", 1, local_rank="1", node_rank="0", hostname="node-a",
                 launcher="torchrun") == 1
    assert value(metrics, "ddp_checkpoint_committed_step", 1) == 6
    # The checkpoint's own commit (its manifest's), not when this rank learnt of it.
    assert value(metrics, "ddp_checkpoint_committed_timestamp_seconds", 1) == 1_700_000_100.0
    assert value(metrics, "ddp_checkpoint_save_seconds_count", 1) == 1
    assert value(metrics, "ddp_checkpoint_save_seconds_bucket", 1, le="0.25") == 1
    assert value(metrics, "ddp_checkpoint_write_seconds_sum", 1) == 1.5


def test_a_resumed_process_exports_where_it_resumed_and_the_checkpoint_until_it_commits_one():
    metrics = endpoint()
    assert value(metrics, "ddp_checkpoint_committed_timestamp_seconds") is None  # none yet: no age to alert on
    assert value(metrics, "ddp_train_loss") is None and value(metrics, "ddp_step") == 0
    metrics.checkpoint_resumed(TrainingPosition(epoch=2, step=40, samples_seen=1280), 1_700_000_000.0)
    # Where training stands from the resume, not 0 until the first new step.
    assert value(metrics, "ddp_step") == 40 and value(metrics, "ddp_epoch") == 2
    assert value(metrics, "ddp_samples_seen") == 1280
    assert value(metrics, "ddp_checkpoint_committed_step") == 40
    assert value(metrics, "ddp_checkpoint_committed_timestamp_seconds") == 1_700_000_000.0
    metrics.checkpoint_committed(60, 1_700_000_500.0)
    assert value(metrics, "ddp_checkpoint_committed_step") == 60
    assert value(metrics, "ddp_checkpoint_committed_timestamp_seconds") == 1_700_000_500.0
    assert value(metrics, "ddp_checkpoint_write_seconds_count") is None  # no write timed here: no series
    assert value(metrics, "ddp_checkpoint_save_seconds_count") == 0  # every rank's, from the start


def test_each_rank_exports_its_own_figures_of_the_slow_rank_comparison():
    comparison = RankComparison(step=30, steps=10, step_s=0.2, parts=(
        PartTimes("data", (0.01, 0.09), (0.09, 0.01), (0.11, 9.0), (False, True)),
        PartTimes("compute", (0.05, 0.05), (0.05, 0.05), (1.0, 1.0), (False, False))), named=frozenset({(1, "data")}))
    first, second = endpoint(rank=0, world_size=2), endpoint(rank=1, world_size=2)
    first.compared(None)  # before the first comparison: nothing
    assert value(first, "ddp_slow_rank_ratio", 0, part="data") is None
    for metrics in (first, second):
        metrics.compared(comparison)
    assert value(second, "ddp_step_part_seconds", 1, part="data") == 0.09
    assert value(second, "ddp_slow_rank_ratio", 1, part="data") == 9.0
    assert value(second, "ddp_slow_rank", 1, part="data") == 1
    assert value(second, "ddp_slow_rank", 1, part="compute") == 0
    assert value(first, "ddp_slow_rank", 0, part="data") == 0
    # Rank 1's figures are rank 1's to export: the node's merged view then holds each series once.
    assert value(first, "ddp_slow_rank_ratio", 1, part="data") is None


def test_local_rank_zero_serves_its_nodes_ranks_and_says_which_one_is_not_answering(monkeypatch):
    for name in ("HTTP_PROXY", "http_proxy"):  # a pod's proxy, for the outside: never between the ranks
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    port = consecutive_free_ports(2)
    zero = endpoint(port, rank=2, local_rank=0, world_size=4, local_world_size=2)
    one = endpoint(port, rank=3, local_rank=1, world_size=4, local_world_size=2)
    zero.start()
    one.start()
    try:
        zero.stepped(TrainingPosition(step=5))
        one.stepped(TrainingPosition(step=4))
        one.checkpoint_saved(3.0)
        url = f"http://127.0.0.1:{port}/metrics"
        for openmetrics in (False, True):
            node = scrape(url, openmetrics)
            assert node.value("ddp_step", job_id=JOB, rank="2") == 5
            assert node.value("ddp_step", job_id=JOB, rank="3") == 4
            assert node.value("ddp_checkpoint_save_seconds_count", job_id=JOB, rank="3") == 1
            assert node.value("ddp_local_rank_up", job_id=JOB, local_rank="1") == 1
        assert scrape(f"http://127.0.0.1:{port + 1}/metrics").ranks("ddp_step") == {"3"}  # its own alone
        one.close()
        node = scrape(url)
        assert node.value("ddp_local_rank_up", job_id=JOB, local_rank="1") == 0
        assert node.ranks("ddp_step") == {"2"}
    finally:
        zero.close()
        one.close()
    listens_again(port)


def test_a_single_process_serves_through_the_runtime_and_frees_its_port():
    port = consecutive_free_ports(1)
    metrics = endpoint(port)
    with metrics.serving(LOG):
        metrics.stepped(TrainingPosition(step=3))
        assert scrape(f"http://127.0.0.1:{port}/metrics").value("ddp_step", job_id=JOB, rank="0") == 3
    listens_again(port)


def test_off_by_default_nothing_listens():
    metrics = MetricsEndpoint(OutputConfig(), identity())
    assert not metrics.enabled
    with metrics.serving(LOG):
        assert metrics._server is None


def test_a_port_that_is_taken_is_one_warning_and_local_rank_zero_still_serves_its_node(caplog):
    port = consecutive_free_ports(2)
    zero = endpoint(port, rank=0, local_rank=0, world_size=2, local_world_size=2)
    one = endpoint(port, rank=1, local_rank=1, world_size=2, local_world_size=2)
    with socket.socket() as taken, caplog.at_level(logging.WARNING, LOG.name):
        taken.bind(("127.0.0.1", port + 1))  # held, not listening: local rank 0's ask is refused at once
        with zero.serving(LOG), one.serving(LOG):  # the run goes on: metrics never fail it
            zero.stepped(TrainingPosition(step=2))
            node = scrape(f"http://127.0.0.1:{port}/metrics")
    assert [record.getMessage() for record in caplog.records] == [
        f"--metrics-port {port}: port {port + 1} (local rank 1's: --metrics-port + 1) on 127.0.0.1 is in use; stop "
        f"what holds it or choose another --metrics-port (this node's ranks use {port} and the ports after it)"]
    assert node.value("ddp_step", job_id=JOB, rank="0") == 2
    assert node.value("ddp_local_rank_up", job_id=JOB, local_rank="1") == 0
    caplog.clear()
    with socket.socket() as taken, caplog.at_level(logging.WARNING, LOG.name):
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the scrape's connection may linger
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with endpoint(port).serving(LOG) as alone:
            assert alone._server is None
    assert caplog.messages == [f"--metrics-port {port}: port {port} on 127.0.0.1 is in use; stop what holds it or "
                               f"choose another --metrics-port"]


def test_an_address_the_node_cannot_have_is_one_warning_a_port_range_it_cannot_have_one_error(caplog):
    nowhere = MetricsEndpoint(OutputConfig(metrics_port=9464, metrics_host="no-such-host.invalid"), identity())
    with caplog.at_level(logging.WARNING, LOG.name), nowhere.serving(LOG):
        pass
    (said,) = caplog.messages
    assert re.fullmatch(r"--metrics-port 9464: cannot listen on no-such-host.invalid:9464 \(.+\); give "
                        r"--metrics-host an address of this machine \(::, the default: all of them\) or choose "
                        r"another --metrics-port", said), said
    with pytest.raises(ConfigError) as refused, endpoint(65534, local_world_size=4, world_size=4).serving(LOG):
        pass
    assert str(refused.value) == ("--metrics-port 65534: this node's 4 ranks listen on it and the 3 ports after it, "
                                  "up to 65537; choose a port <= 65532")


def test_a_forked_child_does_not_keep_the_port_once_the_server_closes():
    """A DataLoader worker, forked after the endpoint started, must not hold its port: were the rank killed, its
    orphaned workers would keep the restarted rank from listening."""
    port = consecutive_free_ports(1)
    metrics = endpoint(port)
    metrics.start()
    release_read, release_write = os.pipe()
    child = os.fork()
    if child == 0:  # the worker: alive until the test is done, holding whatever it inherited
        os.read(release_read, 1)
        os._exit(0)
    try:
        metrics.close()
        listens_again(port)
    finally:
        os.write(release_write, b"x")
        os.waitpid(child, 0)
        os.close(release_read)
        os.close(release_write)


def test_an_idle_connection_is_closed_by_the_server(monkeypatch):
    monkeypatch.setattr("trainer.prometheus._Handler.timeout", 0.2)
    port = consecutive_free_ports(1)
    metrics = endpoint(port)
    with metrics.serving(LOG), socket.create_connection(("127.0.0.1", port), timeout=30) as idle:
        idle.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
        assert idle.recv(1) == b""  # closed by the server; without a timeout, this client's own 30 s would end it


def test_by_default_local_rank_zero_listens_on_ipv6_and_ipv4(monkeypatch):
    assert OutputConfig().metrics_host == ALL_ADDRESSES
    port = consecutive_free_ports(1)
    both = MetricsEndpoint(OutputConfig(metrics_port=port), identity())
    with both.serving(LOG):
        for url in (f"http://127.0.0.1:{port}/metrics", f"http://[::1]:{port}/metrics"):
            assert scrape(url).value("ddp_step", job_id=JOB, rank="0") == 0
    monkeypatch.setattr(socket, "has_ipv6", False)  # a kernel without IPv6: every IPv4 address instead
    ipv4 = MetricsEndpoint(OutputConfig(metrics_port=port), identity())
    with ipv4.serving(LOG):
        assert ipv4._server.address_family == socket.AF_INET
        assert scrape(f"http://127.0.0.1:{port}/metrics").value("ddp_step", job_id=JOB, rank="0") == 0


@pytest.mark.parametrize(("settings", "message"), [
    ({"metrics_port": 70000}, "--metrics-port 70000: a TCP port is 1-65535 (0: off)"),
    ({"metrics_port": -1}, "--metrics-port -1: a TCP port is 1-65535 (0: off)"),
    ({"metrics_host": " "}, "--metrics-host must be an address (::, the default: all of this machine's)"),
])
def test_the_flags_refuse_what_is_no_port_or_address(settings, message):
    with pytest.raises(ConfigError) as refused:
        OutputConfig(**settings)
    assert str(refused.value) == message


def promql_names(node: Any) -> set[str]:
    """Every metric an expression selects."""
    if isinstance(node, promql_parser.VectorSelector):
        return {node.name}
    children = [getattr(node, name, None) for name in ("lhs", "rhs", "expr", "args", "param", "vector_selector")]
    return {name for child in children if child is not None
            for item in (child if isinstance(child, list) else [child]) for name in promql_names(item)}


def test_the_documented_alerts_parse_and_select_only_metrics_the_endpoint_exports():
    metrics = endpoint(rank=1, world_size=2)
    metrics.stepped(TrainingPosition(step=1))
    metrics.record("train", {"loss": 0.5, "accuracy": 0.5, "lr": 0.1, "samples_per_s": 1.0, "mfu": 0.1,
                             "flops_per_s_per_device": 1.0})
    metrics.record("test", {"loss": 0.5, "accuracy": 0.5})
    metrics.step_time(0.1)
    data = PartTimes("data", (0.1, 0.1), (0.1, 0.1), (1.0, 1.0), (False, False))
    metrics.compared(RankComparison(30, 10, 0.2, (data,), frozenset()))
    metrics.checkpoint_saved(1.0)
    metrics.checkpoint_committed(2, 1_700_000_000.0, write_s=1.0)
    exported = {sample.name for family in metrics.registry.collect() for sample in family.samples}
    exported |= {"ddp_local_rank_up", "up"}  # local rank 0's own (NodeCollector), Prometheus's own
    page = (REPO_ROOT / "docs" / "tracking.md").read_text()
    blocks = re.findall(r"```promql\n(.*?)```", page, re.DOTALL)
    expressions = [line for block in blocks for line in block.splitlines() if line.strip() and not
                   line.startswith("#")]
    assert len(expressions) >= 6  # stalled, stale checkpoint, slow rank, restarts, resizes, a silent rank
    for expression in expressions:
        selected = promql_names(promql_parser.parse(expression))  # ValueError: not PromQL
        assert selected and selected <= exported, (expression, selected - exported)
