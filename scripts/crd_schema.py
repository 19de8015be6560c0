"""A custom resource's API as a JSON schema the tests check the manifests against offline: KubeRay's RayJob
(tests/support/kuberay_api.py), Kubeflow Trainer's TrainJob of each release claimed (tests/support/trainer_crds.py) and
prometheus-operator's PodMonitor (tests/support/prometheus_operator.py).

KubeRay publishes no Python models, and PyPI's kubeflow-trainer-api is one Trainer release at a time; each release's
CRD file holds its API's structural schema, which the API server itself checks: 0.2 to 1.4 MB, mostly descriptions
and, in KubeRay's, pod templates. This keeps the fields,
their types, what is required and the bounds on lengths and counts, strictly (a field the API does not declare is an
error, as under kubectl's strict field validation), and each list's `x-kubernetes-list-type` of map or set with its
keys: the API server refuses two items with the same keys (two env entries of one name), a JSON schema has no word
for it (tests/support/structural_schema.py checks it). It leaves out the descriptions, the CEL rules
(`x-kubernetes-validations`) and the inside of each Kubernetes pod template, which Kubernetes' own schema checks
(kubernetes-validate), all but the pod template's list types: Kubernetes' JSON schema does not carry them, and the
API server checks them in a custom resource's pods. Run it again for a newer release:

    python scripts/crd_schema.py ray.io_rayjobs.yaml "KubeRay vX.Y (commit)" \
        > tests/fixtures/kuberay-rayjob.schema.json
    git -C trainer show vX.Y.Z:manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml > trainjobs.yaml
    python scripts/crd_schema.py trainjobs.yaml "kubeflow/trainer manifests/base/crds/... at tag vX.Y.Z" \
        > tests/fixtures/trainer-trainjob-vX.Y.Z.schema.json
    git -C prometheus-operator show vX.Y.Z:example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml \
        > podmonitors.yaml
    python scripts/crd_schema.py podmonitors.yaml "prometheus-operator/prometheus-operator example/... at tag vX.Y.Z" \
        > tests/fixtures/prometheus-operator-vX.Y.Z-podmonitor.schema.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

POD_TEMPLATE = {"x-pod-template": True, "type": "object"}
# "atomic", a list's default, constrains nothing.
UNIQUE_LIST_TYPES = ("map", "set")


def strict(node: dict[str, Any]) -> dict[str, Any]:
    """The schema ``node`` as JSON Schema: no descriptions, unknown fields refused, pod templates marked."""
    properties = node.get("properties", {})
    # Kubernetes' PodSpec requires its containers; Trainer's runtime patches (PodSpecPatch) hold containers too, but
    # optional, and only the fields a TrainJob may patch: those are kept, strictly.
    if {"metadata", "spec"} <= properties.keys() and "containers" in properties["spec"].get("required", []):
        return {**POD_TEMPLATE, **list_types(node)}
    out: dict[str, Any] = list_marker(node)
    if node.get("x-kubernetes-int-or-string"):
        return {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    if "type" in node:
        out["type"] = node["type"]
    for key in ("enum", "required", "format", "minimum", "maximum", "pattern", "minItems", "maxItems", "minLength",
                "maxLength"):
        if key in node:
            out[key] = node[key]
    if properties:
        out["properties"] = {name: strict(child) for name, child in properties.items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    elif isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(node["additionalProperties"])
    if "items" in node:
        out["items"] = strict(node["items"])
        out["items"] = _merge(out["items"], map_key_defaults(node))
    return out


def list_marker(node: dict[str, Any]) -> dict[str, Any]:
    """The node's list type and keys, when they make items unique."""
    if node.get("x-kubernetes-list-type") not in UNIQUE_LIST_TYPES:
        return {}
    return {key: node[key] for key in ("x-kubernetes-list-type", "x-kubernetes-list-map-keys") if key in node}


def map_key_defaults(node: dict[str, Any]) -> dict[str, Any]:
    """The defaults of a list map's keys (a port's protocol is TCP): the API server defaults before comparing."""
    item_properties = node.get("items", {}).get("properties", {})
    defaults = {key: {"default": item_properties[key]["default"]} for key in node.get("x-kubernetes-list-map-keys", [])
                if "default" in item_properties.get(key, {})}
    return {"properties": defaults} if defaults else {}


def list_types(node: dict[str, Any]) -> dict[str, Any]:
    """Only the list types under ``node`` (a pod template's), on the paths that lead to them: no types, no fields."""
    out = list_marker(node)
    properties = {name: inner for name, child in node.get("properties", {}).items() if (inner := list_types(child))}
    if properties:
        out["properties"] = properties
    if isinstance(node.get("additionalProperties"), dict) and (inner := list_types(node["additionalProperties"])):
        out["additionalProperties"] = inner
    if "items" in node and (inner := _merge(list_types(node["items"]), map_key_defaults(node))):
        out["items"] = inner
    return out


def _merge(schema: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with the map keys' defaults added to its properties."""
    if not defaults:
        return schema
    properties = dict(schema.get("properties", {}))
    for key, default in defaults["properties"].items():
        properties[key] = {**properties.get(key, {}), **default}
    return {**schema, "properties": properties}


def main(crd_path: str, source: str) -> None:
    crd = yaml.safe_load(Path(crd_path).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    schema = version["schema"]["openAPIV3Schema"]
    schema["properties"].pop("status", None)  # the operator's to write
    out = {"source": source, "apiVersion": f"{crd['spec']['group']}/{version['name']}", **strict(schema)}
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
