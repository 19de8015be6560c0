"""The Prometheus endpoint (--metrics-port): what an operator alerts on, from every rank, one scrape per node.

One endpoint per node, not per rank: local rank 0 serves ``GET /metrics`` at --metrics-host:--metrics-port with its
own series and those of its node's other ranks, which serve theirs on 127.0.0.1 only, at --metrics-port + local
rank, and which it asks at each scrape. A node (a pod) is then one scrape target whatever its number of ranks: a
PodMonitor names one container port, where endpoints per rank would need a pod's declared ports to follow its
nprocPerNode, and a static scrape config lists one address per node. Every series still carries the rank it is
about (``rank``) and the job (``job_id``, the checkpoint lease's job name: the same for all of a job's restarts).
A local rank that does not answer within LOCAL_RANK_TIMEOUT_S is left out of that scrape and shows as
``ddp_local_rank_up 0``; local rank 0's own absence is Prometheus's ``up == 0``.

Never in the training's way: the loop only sets numbers (a lock each, no I/O); prometheus_client's HTTP server
answers from threads of its own, so a scrape still answers while the training waits in a collective. Each process
has a registry of its own, never prometheus_client's global one, which any imported library may fill.

What is exported (docs/tracking.md, "Prometheus" has the PromQL alerts): where training stands (``ddp_step``, the
time of the last optimizer step, samples/s, the mean step time of the last log window and its parts), the
training and evaluation loss and metrics, the newest committed checkpoint (its step and time: the one resumed from,
then each one saved) and how long saves took, the launcher's restart count and the world size, and the slow-rank
signal.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import socket
import sys
import threading
import time
import urllib.request
import weakref
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Gauge, Histogram, Info, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics import parser as openmetrics_parser

from trainer.config import OutputConfig
from trainer.errors import ConfigError
from trainer.launchers import DistIdentity
from trainer.position import TrainingPosition
from trainer.slow_rank import RankComparison

__all__ = ["ALL_ADDRESSES", "CONNECTION_TIMEOUT_S", "LOCAL_RANK_TIMEOUT_S", "MetricsEndpoint", "merged"]

# A local rank's answer to local rank 0, within one scrape: Prometheus's default scrape timeout is 10 s, and the
# other local ranks are asked in parallel.
LOCAL_RANK_TIMEOUT_S = 3.0
LOOPBACK = "127.0.0.1"
# --metrics-host's default: every address of both families (an IPv6 socket that takes IPv4 too), so that IPv4, IPv6
# and dual-stack clusters can all scrape; where the kernel has no IPv6, every IPv4 address.
ALL_ADDRESSES, ALL_IPV4 = "::", "0.0.0.0"
# A connection that sends no request within this is closed: idle ones would each hold a thread (Prometheus sends
# its request at once, and waits up to its scrape timeout, 10 s by default, for the answer, which this does not
# bound).
CONNECTION_TIMEOUT_S = 10.0
# OpenMetrics between the ranks, not the classic text format: its parser gives back each family whole (a counter's
# or histogram's _created inside it), so the merged families are exposed exactly as each rank's own would be.
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
# Checkpoint saves: from a small model's fraction of a second to the default --checkpoint-timeout-s (1800 s).
SAVE_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# A record's fields left out: where training stands comes from ``stepped``. Of the rest, those without a metric of
# their own (MetricsEndpoint.train_fields) are the task's metrics: ddp_train_metric / ddp_eval_metric by name.
NOT_EXPORTED = {"epoch", "samples_seen", "samples"}


class MetricsEndpoint:
    """This rank's metrics, and where --metrics-port is set, the server that exposes them (``serving``).

    A series appears with its first value: a loss or a checkpoint's time never set is absent, not 0 (a checkpoint
    committed at Unix time 0 would be an alert at once)."""

    def __init__(self, config: OutputConfig, identity: DistIdentity) -> None:
        self.port, self.host = config.metrics_port, config.metrics_host
        self.identity = identity
        self.registry = CollectorRegistry()
        self._server: Any = None
        self._thread: Any = None
        self._mine = (identity.job, str(identity.rank))
        labels = ("job_id", "rank")

        def gauge(name: str, help: str, *more: str) -> Gauge:
            return Gauge(name, help, (*labels, *more), registry=self.registry)

        Info("ddp_rank", "where this rank runs", labels, registry=self.registry).labels(*self._mine).info({
            "local_rank": str(identity.local_rank), "node_rank": str(identity.node_rank),
            "hostname": identity.hostname, "launcher": identity.launcher})
        started = time.time()
        for name, help, known in (
                ("ddp_world_size", "ranks in the group this process joined", identity.world_size),
                ("ddp_restarts", "the launcher's count of restarts before this attempt (TORCHELASTIC_RESTART_COUNT, "
                                 "SLURM_RESTART_COUNT): 0 on the first", identity.restart_count),
                ("ddp_start_timestamp_seconds", "when this rank's endpoint started, in Unix time", started)):
            gauge(name, help).labels(*self._mine).set(known)
        self.step = gauge("ddp_step", "optimizer steps done, resumed ones included")
        self.epoch = gauge("ddp_epoch", "epochs completed")
        self.samples_seen = gauge("ddp_samples_seen", "training samples of every rank seen in the run")
        # From the start: a start-up that never reaches a first step (a hung download) ages as a stalled step does.
        self.last_step = gauge("ddp_last_step_timestamp_seconds", "when this rank finished its last optimizer step "
                                                                  "(before the first: when it started), in Unix time")
        for series in (self.step, self.epoch, self.samples_seen):
            self._of(series).set(0)
        self._of(self.last_step).set(started)
        self.samples_per_s = gauge("ddp_samples_per_second", "every rank's training samples per second over the last "
                                                             "log window (--log-every)")
        self.step_s = gauge("ddp_step_seconds", "the mean optimizer step over the last log window")
        # The slow-rank detector's (trainer.slow_rank): each rank exports its own figures, so that the node's merged
        # view holds each rank's once.
        self.parts = gauge("ddp_step_part_seconds", "this rank's mean optimizer step, by part (data: waiting for "
                           "batches and their copy to the device; compute: the forward pass and loss), over the "
                           "slow-rank detector's last window", "part")
        self.ratio = gauge("ddp_slow_rank_ratio", "this rank's time for a part of the step as a multiple of the other "
                           "ranks' median, over the slow-rank detector's last window", "part")
        self.named = gauge("ddp_slow_rank", "1 while the slow-rank detector names this rank slow in a part (slow in "
                           "several comparisons in a row), else 0", "part")
        self.loss = {"train": gauge("ddp_train_loss", "the training loss over the last log window"),
                     "test": gauge("ddp_eval_loss", "the evaluation loss at the last evaluation")}
        self.task_metrics = {
            "train": gauge("ddp_train_metric", "the task's training metrics over the last log window", "metric"),
            "test": gauge("ddp_eval_metric", "the task's evaluation metrics at the last evaluation", "metric")}
        # A train record's fields with a metric of their own.
        self.train_fields = {
            "lr": gauge("ddp_learning_rate", "the learning rate of the last optimizer step logged"),
            "samples_per_s": self.samples_per_s,
            "mfu": gauge("ddp_mfu_ratio", "model FLOPs utilisation over the last log window (where the device's peak "
                                          "is known)"),
            "flops_per_s_per_device": gauge("ddp_flops_per_second_per_device", "achieved model FLOP/s per device over "
                                                                               "the last log window (where counted)")}
        # The checkpoint a restart would resume from: the one this process resumed from, then each it commits.
        self.committed_step = gauge("ddp_checkpoint_committed_step", "the step of the newest checkpoint every rank "
                                    "knows committed: the one resumed from, then each one saved (under "
                                    "--async-checkpoint, known at the next save or the run's end)")
        self.committed_at = gauge("ddp_checkpoint_committed_timestamp_seconds",
                                  "when that checkpoint was committed (its manifest's created_unix), in Unix time")
        self.save_s = Histogram("ddp_checkpoint_save_seconds", "how long training waited for each checkpoint save "
                                "(a synchronous save's write; an asynchronous save's copy to host memory)", labels,
                                registry=self.registry, buckets=SAVE_BUCKETS_S)
        self._of(self.save_s)  # every rank waits for each save: 0 saves is a count, from the start
        self.write_s = Histogram("ddp_checkpoint_write_seconds", "rank 0's write of each committed checkpoint, from "
                                 "serialising to the commit (in the background under --async-checkpoint)", labels,
                                 registry=self.registry, buckets=SAVE_BUCKETS_S)

    def _of(self, family: Any, *more: str) -> Any:
        """This rank's series of ``family`` (made at the first call), ``more`` its other labels' values."""
        return family.labels(*self._mine, *more)

    # -- the training thread's side: numbers set, nothing waited for ---------------------------------------
    def stepped(self, position: TrainingPosition) -> None:
        """An optimizer step is done (every step: what a stalled job's alert watches)."""
        self._of(self.step).set(position.step)
        self._of(self.epoch).set(position.epoch)
        self._of(self.samples_seen).set(position.samples_seen)
        self._of(self.last_step).set(time.time())

    def record(self, kind: str, values: Mapping[str, float]) -> None:
        """A metrics.jsonl record: "train" (a log window's) or "test" (an evaluation's); other kinds are not
        exported."""
        if kind not in self.loss:
            return
        for name, value in values.items():
            if not isinstance(value, int | float) or isinstance(value, bool) or name in NOT_EXPORTED:
                continue
            if name == "loss":
                self._of(self.loss[kind]).set(value)
            elif kind == "train" and name in self.train_fields:
                self._of(self.train_fields[name]).set(value)
            else:
                self._of(self.task_metrics[kind], name).set(value)

    def step_time(self, seconds: float) -> None:
        """The mean optimizer step of the log window just recorded."""
        self._of(self.step_s).set(seconds)

    def compared(self, comparison: RankComparison | None) -> None:
        """The slow-rank detector's newest comparison of the ranks (the same on every rank; None before the first):
        this rank's parts of a step, each against the other ranks' median, and whether it is named slow in it."""
        if comparison is None:
            return
        rank = self.identity.rank
        for times in comparison.parts:
            self._of(self.parts, times.part).set(times.seconds_per_step[rank])
            self._of(self.ratio, times.part).set(times.ratios[rank])
            self._of(self.named, times.part).set(int((rank, times.part) in comparison.named))

    def checkpoint_saved(self, seconds: float) -> None:
        """Training waited ``seconds`` for a save (its outcome may come later: ``checkpoint_committed``)."""
        self._of(self.save_s).observe(seconds)

    def checkpoint_resumed(self, position: TrainingPosition, created_unix: float | None) -> None:
        """This process resumed at ``position`` from its checkpoint, committed at ``created_unix`` (its manifest's;
        None in a format that has none): where training stands from now, not 0 until the first new step, and the
        checkpoint a restart would resume from, until this process commits one."""
        self.stepped(position)
        self._of(self.committed_step).set(position.step)
        if created_unix is not None:
            self._of(self.committed_at).set(created_unix)

    def checkpoint_committed(self, step: int, created_unix: float | None, write_s: float | None = None) -> None:
        """Every rank has learnt that the checkpoint of ``step`` committed at ``created_unix`` (its manifest's; now
        where unknown): under --async-checkpoint, at the next save or the run's end. ``write_s``: its write, on
        rank 0."""
        self._of(self.committed_step).set(step)
        self._of(self.committed_at).set(time.time() if created_unix is None else created_unix)
        if write_s is not None:
            self._of(self.write_s).observe(write_s)

    # -- the server ----------------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.port != 0

    @property
    def address(self) -> tuple[str, int]:
        """Where this rank listens: local rank 0 where asked, the others on loopback, one port each after it."""
        local_rank = self.identity.local_rank
        return (self.host, self.port) if local_rank == 0 else (LOOPBACK, self.port + local_rank)

    @contextlib.contextmanager
    def serving(self, log: logging.Logger) -> Iterator[MetricsEndpoint]:
        """Serve while the run lasts (nothing where --metrics-port is 0). Like the experiment trackers, never in
        the run's way: a rank that cannot listen says so in one warning and trains without its endpoint."""
        try:
            if self.enabled:
                try:
                    self.start()
                except OSError as error:
                    log.warning("%s", _listen_error(error, self.port, *self.address, self.identity.local_rank))
            yield self
        finally:
            self.close()

    def start(self) -> None:
        """Listen; OSError where this rank cannot (``serving`` says why), ConfigError, one line, where this node's
        ranks' ports would pass 65535."""
        host, port = self.address
        last = self.port + self.identity.local_world_size - 1
        if last > 65535:
            raise ConfigError(f"--metrics-port {self.port}: this node's {self.identity.local_world_size} ranks listen "
                              f"on it and the {self.identity.local_world_size - 1} ports after it, up to {last}; "
                              f"choose a port <= {65536 - self.identity.local_world_size}")
        served = self.registry
        if self.identity.local_rank == 0 and self.identity.local_world_size > 1:
            served = CollectorRegistry()
            served.register(NodeCollector(self.registry, self.identity.job, self.port,
                                          self.identity.local_world_size))
        self._server = _listen(host, port, served)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-endpoint", daemon=True)
        self._thread.start()
        # A process forked from this one (a DataLoader worker) inherits the listening socket: were this rank
        # killed, its orphaned workers would hold the port and the restarted rank could not listen. Registered
        # once per server and never removable: a weak reference, a no-op once closed.
        os.register_at_fork(after_in_child=functools.partial(_closed_in_child, weakref.ref(self)))

    def close(self) -> None:
        """Stop serving and free the port: a launcher that runs the trainer again in this process (Ray Train's
        workers) can listen there again."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()  # returns once serve_forever has seen it (at most its 0.5 s poll)
            server.server_close()
            self._thread.join()


def _closed_in_child(endpoint: weakref.ref[MetricsEndpoint]) -> None:
    """In a forked child: the parent's listening socket closed there (the parent's own stays open). No serving
    thread runs in a child, so there is nothing to shut down."""
    alive = endpoint()
    if alive is not None and alive._server is not None:
        alive._server.socket.close()
        alive._server = None


class _Server(ThreadingWSGIServer):
    """prometheus_client's threaded server, with a read timeout on each connection, and IPv4 too on an IPv6
    socket for every address (the kernel's default, net.ipv6.bindv6only, may say otherwise)."""

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.server_address[0] == ALL_ADDRESSES:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone or silent past CONNECTION_TIMEOUT_S: closed without the default's traceback."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Handler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged: every 15-60 s, they would fill the run's log."""


def _listen(host: str, port: int, registry: CollectorRegistry) -> _Server:
    """The server, bound and listening (OSError where it cannot: socket.gaierror for a host that names no address).
    The default, every address, falls back to every IPv4 one where the kernel has no IPv6."""
    if host == ALL_ADDRESSES and not socket.has_ipv6:
        host = ALL_IPV4
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("_BoundServer", (_Server,), {"address_family": family})
    try:
        return make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_Handler)
    except OSError as error:
        if host != ALL_ADDRESSES or error.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
            raise
        return _listen(ALL_IPV4, port, registry)  # IPv6 compiled in, but off on this kernel


def _listen_error(error: OSError, flag_port: int, host: str, port: int, local_rank: int) -> str:
    whose = "" if local_rank == 0 else f" (local rank {local_rank}'s: --metrics-port + {local_rank})"
    if error.errno == errno.EADDRINUSE:
        fix = ("stop what holds it or choose another --metrics-port" + (f" (this node's ranks use {flag_port} and "
               f"the ports after it)" if local_rank else ""))
        return f"--metrics-port {flag_port}: port {port}{whose} on {host} is in use; {fix}"
    return (f"--metrics-port {flag_port}: cannot listen on {host}:{port}{whose} ({error.strerror or error}); give "
            f"--metrics-host an address of this machine (::, the default: all of them) or choose another "
            f"--metrics-port")


class NodeCollector:
    """Local rank 0's view of its node: its own families and each other local rank's, asked for at every scrape,
    merged by name (every series carries its rank, so none collide)."""

    def __init__(self, own: CollectorRegistry, job: str, port: int, local_world_size: int,
                 timeout_s: float = LOCAL_RANK_TIMEOUT_S) -> None:
        self.own = own
        self.job = job
        self.urls = {local_rank: f"http://{LOOPBACK}:{port + local_rank}/metrics"
                     for local_rank in range(1, local_world_size)}
        self.timeout_s = timeout_s
        # Straight to the loopback: a pod's HTTP_PROXY, which urllib would otherwise honour, is for the outside.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def describe(self) -> list[Metric]:
        return []  # registered without a scrape of the other ranks, and its names checked against nothing

    def collect(self) -> list[Metric]:
        families = list(self.own.collect())
        up = GaugeMetricFamily("ddp_local_rank_up", "whether this node's local rank answered local rank 0 within "
                               f"{self.timeout_s:g}s at this scrape", labels=["job_id", "local_rank"])
        up.add_metric([self.job, "0"], 1)
        with ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="metrics-local-rank") as pool:
            answers = dict(zip(self.urls, pool.map(self._ask, self.urls.values()), strict=True))
        for local_rank, answer in answers.items():
            up.add_metric([self.job, str(local_rank)], 0 if answer is None else 1)
            families.extend(answer or [])
        return merged([*families, up])

    def _ask(self, url: str) -> list[Metric] | None:
        """A local rank's families; None when it does not answer in time or answers with no metrics."""
        request = urllib.request.Request(url, headers={"Accept": OPENMETRICS})
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                text = response.read().decode("utf-8")
            return list(openmetrics_parser.text_string_to_metric_families(text))
        except (OSError, ValueError):  # gone, too slow, or cut off mid-answer
            return None


def merged(families: Iterable[Metric]) -> list[Metric]:
    """Families of the same name as one, their samples in order: one family per name is what both exposition
    formats allow."""
    by_name: dict[str, Metric] = {}
    for family in families:
        kept = by_name.get(family.name)
        if kept is None:
            kept = by_name[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
        kept.samples.extend(family.samples)
    return list(by_name.values())
