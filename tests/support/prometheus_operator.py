"""What the prometheus-operator makes of a PodMonitor, for tests without a cluster: its API (the CRD's schema,
tests/fixtures/prometheus-operator-v0.93.0-podmonitor.schema.json, made by scripts/crd_schema.py) and the targets it
has Prometheus scrape on a pod.

Transcribed from prometheus-operator v0.93.0, pkg/prometheus/promcfg.go (generatePodMonitorConfig): Prometheus's pod
discovery makes one target per port a pod's containers declare, at the pod's address and that port; the operator
keeps those of pods the selector selects and, for each of the monitor's podMetricsEndpoints, those whose port has
the endpoint's name (``port``) or number (``portNumber``), then applies the endpoint's relabelings. Only the
``replace`` relabeling of ``__address__`` is emulated, what k8s/components/prometheus uses; any other fails."""

from __future__ import annotations

import re
from typing import Any

from devtools.processes import REPO_ROOT
from tests.support.network_policy import selects
from tests.support.structural_schema import crd_errors

Obj = dict[str, Any]
SCHEMA = REPO_ROOT / "tests" / "fixtures" / "prometheus-operator-v0.93.0-podmonitor.schema.json"


def podmonitor_errors(podmonitor: Obj) -> list[str]:
    """Where the PodMonitor breaks the CRD's schema: "path: message" each; [] when the API server takes it."""
    return crd_errors(podmonitor, SCHEMA)


def targets(podmonitor: Obj, pod_labels: dict[str, str], ports: list[Obj], address: str = "10.0.0.7") -> list[str]:
    """The addresses Prometheus scrapes on a pod at ``address`` with these labels and declared container ports."""
    if not selects(podmonitor["spec"]["selector"], pod_labels):
        return []
    found = []
    for endpoint in podmonitor["spec"]["podMetricsEndpoints"]:
        for port in ports:
            if "port" in endpoint:
                kept = port.get("name") == endpoint["port"]
            else:
                kept = "portNumber" in endpoint and port["containerPort"] == endpoint["portNumber"]
            if kept:
                found.append(_relabelled(f"{address}:{port['containerPort']}", endpoint.get("relabelings", [])))
    return found


def _relabelled(target: str, relabelings: list[Obj]) -> str:
    for rule in relabelings:
        if rule.get("action", "replace") != "replace" or rule.get("sourceLabels") != ["__address__"] \
                or rule.get("targetLabel") != "__address__":
            raise AssertionError(f"relabeling not emulated: {rule}")
        # Prometheus anchors the regex at both ends; no match leaves the label as it was.
        matched = re.fullmatch(rule.get("regex", "(.*)"), target)
        if matched:
            target = re.sub(r"\$\{(\d+)\}|\$(\d+)", lambda ref, groups=matched: groups.group(int(ref.group(1) or
                                                                                           ref.group(2))),
                            rule.get("replacement", "$1"))
    return target
