"""Which connections a set of NetworkPolicies lets into a pod, as the API documents them (networking.k8s.io/v1):
a pod no policy selects accepts everything; one that some Ingress policy selects accepts only what one of its rules
admits. A peer's podSelector alone means the policy's own namespace; with a namespaceSelector, the namespaces it
selects; an empty selector selects everything. A rule without ports admits every port; without from, every peer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]


@dataclass(frozen=True)
class Pod:
    labels: dict[str, str]
    namespace: str = "training"
    namespace_labels: dict[str, str] = field(default_factory=dict)


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions, all must hold) against a set of labels."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, values = expression["key"], expression.get("values", [])
        held = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[expression["operator"]]
        if not held:
            return False
    return True


def admitted(policies: list[Obj], source: Pod, target: Pod, port: int) -> bool:
    """Whether a TCP connection from `source` reaches `target` on `port`, under the policies of target's namespace."""
    guarding = [policy for policy in policies if "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])
                and selects(policy["spec"]["podSelector"], target.labels)]
    if not guarding:
        return True
    return any(_rule_admits(rule, source, target, port)
               for policy in guarding for rule in policy["spec"].get("ingress", []))


def _rule_admits(rule: Obj, source: Pod, target: Pod, port: int) -> bool:
    ports = rule.get("ports")
    if any(isinstance(item.get("port"), str) or "endPort" in item for item in ports or []):
        raise AssertionError(f"named ports and port ranges are not emulated: {ports}")
    if ports is not None and not any(item.get("protocol", "TCP") == "TCP" and item.get("port") in (None, port)
                                     for item in ports):
        return False
    peers = rule.get("from")
    return peers is None or any(_peer_admits(peer, source, target) for peer in peers)


def _peer_admits(peer: Obj, source: Pod, target: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # pod-to-pod traffic is judged by the selectors; an address range is not emulated
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], source.namespace_labels)
    else:
        in_namespace = source.namespace == target.namespace
    return in_namespace and selects(peer.get("podSelector", {}), source.labels)
