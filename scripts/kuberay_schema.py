"""KubeRay's RayJob API as a JSON schema the tests check k8s/ray/ against offline (tests/support/kuberay_api.py).

KubeRay publishes no Python models; its CRD file (ray-operator/config/crd/bases/ray.io_rayjobs.yaml) holds the
API's structural schema, 1.4 MB, mostly pod templates and descriptions. This keeps the fields, their types and
what is required, strictly (a field the API does not declare is an error, as under kubectl's strict field
validation), and leaves out the descriptions and the inside of each pod template, which Kubernetes' own schema
checks (kubernetes-validate). Run it again for a newer KubeRay:

    python scripts/kuberay_schema.py ray.io_rayjobs.yaml "KubeRay vX.Y (commit)" \
        > tests/fixtures/kuberay-rayjob.schema.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

POD_TEMPLATE = {"x-pod-template": True, "type": "object"}


def strict(node: dict[str, Any]) -> dict[str, Any]:
    """The schema ``node`` as JSON Schema: no descriptions, unknown fields refused, pod templates marked."""
    properties = node.get("properties", {})
    if {"metadata", "spec"} <= properties.keys() and "containers" in properties["spec"].get("properties", {}):
        return POD_TEMPLATE
    out: dict[str, Any] = {}
    if node.get("x-kubernetes-int-or-string"):
        return {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    if "type" in node:
        out["type"] = node["type"]
    for key in ("enum", "required", "format", "minimum", "maximum", "pattern"):
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
    return out


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
