"""Scraping a trainer's metrics endpoint (trainer.prometheus) as Prometheus does, and reading the answer with
prometheus_client's own parsers: the classic text format, or OpenMetrics, which Prometheus asks for first."""

from __future__ import annotations

import socket
import urllib.request
from collections import Counter
from dataclasses import dataclass

from prometheus_client import parser
from prometheus_client.openmetrics import parser as openmetrics_parser

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


@dataclass(frozen=True)
class Scrape:
    """One answer: each sample's value by (sample name, sorted labels)."""

    values: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    def value(self, name: str, **labels: str) -> float | None:
        return self.values.get((name, tuple(sorted(labels.items()))))

    def of_rank(self, name: str, rank: int) -> list[float]:
        """Every value of ``name`` whose rank label is ``rank``, whatever its other labels."""
        return [value for (sample, labels), value in self.values.items()
                if sample == name and ("rank", str(rank)) in labels]

    def ranks(self, name: str) -> set[str]:
        return {dict(labels).get("rank", "") for sample, labels in self.values if sample == name}


def scrape(url: str, openmetrics: bool = False, timeout_s: float = 10) -> Scrape:
    """GET ``url`` and parse it; a family given twice, or a sample twice, fails (Prometheus refuses the first and
    drops the second)."""
    headers = {"Accept": OPENMETRICS} if openmetrics else {}
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy of the environment's
    with direct.open(urllib.request.Request(url, headers=headers), timeout=timeout_s) as response:
        text = response.read().decode("utf-8")
    families = list((openmetrics_parser if openmetrics else parser).text_string_to_metric_families(text))
    twice = [name for name, count in Counter(family.name for family in families).items() if count > 1]
    assert not twice, f"families given twice: {twice}"
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in families:
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in values, f"sample given twice: {key}"
            values[key] = sample.value
    return Scrape(values)


def consecutive_free_ports(count: int) -> int:
    """The first of ``count`` consecutive TCP ports free on 127.0.0.1 now (a node's ranks listen on PORT + local
    rank)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count - 1 > 65535:
            continue
        sockets = []
        try:
            for port in range(first, first + count):
                held = socket.socket()
                sockets.append(held)
                held.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for held in sockets:
                held.close()
    raise AssertionError(f"no {count} consecutive free ports found on 127.0.0.1")
