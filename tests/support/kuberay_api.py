"""KubeRay's RayJob checked against its API offline: the fields, types and required ones of KubeRay's CRD
(tests/fixtures/kuberay-rayjob.schema.json, made by scripts/crd_schema.py), strictly, and its list maps' keys, pod
templates' too (two env entries of one name: tests/support/structural_schema.py); each pod template inside against
Kubernetes' own schema (kubernetes-validate), as the PyTorchJob's are."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kubernetes_validate

from devtools.processes import REPO_ROOT
from tests.support.structural_schema import crd_errors

Obj = dict[str, Any]
SCHEMA = REPO_ROOT / "tests" / "fixtures" / "kuberay-rayjob.schema.json"


def rayjob_errors(rayjob: Obj) -> list[str]:
    """Where the RayJob breaks KubeRay's schema: "path: message" each; [] when it passes. Of a pod template the
    schema holds only its list types; pod_template_errors checks the rest."""
    return crd_errors(rayjob, SCHEMA)


def pod_templates(rayjob: Obj) -> Iterator[tuple[tuple[str | int, ...], Obj]]:
    """(path, template) of each pod template: the head's, each worker group's, the submitter's."""
    spec = rayjob.get("spec", {})
    cluster = spec.get("rayClusterSpec", {})
    if "template" in cluster.get("headGroupSpec", {}):
        yield ("spec", "rayClusterSpec", "headGroupSpec", "template"), cluster["headGroupSpec"]["template"]
    for index, group in enumerate(cluster.get("workerGroupSpecs", [])):
        if "template" in group:
            yield ("spec", "rayClusterSpec", "workerGroupSpecs", index, "template"), group["template"]
    if "submitterPodTemplate" in spec:
        yield ("spec", "submitterPodTemplate"), spec["submitterPodTemplate"]


def pod_template_errors(rayjob: Obj, version: str) -> list[str]:
    errors = []
    for path, template in pod_templates(rayjob):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        try:
            kubernetes_validate.validate(wrapped, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{'.'.join(map(str, path))}: {error.message}")
    return errors
