"""KubeRay's RayJob checked against its API offline: the fields, types and required ones of KubeRay's CRD
(tests/fixtures/kuberay-rayjob.schema.json, made by scripts/kuberay_schema.py), strictly; each pod template inside
against Kubernetes' own schema (kubernetes-validate), as the PyTorchJob's are."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import kubernetes_validate

from devtools.processes import REPO_ROOT

Obj = dict[str, Any]
SCHEMA = REPO_ROOT / "tests" / "fixtures" / "kuberay-rayjob.schema.json"


@functools.cache
def _schema() -> Obj:
    return json.loads(SCHEMA.read_text())


def rayjob_errors(rayjob: Obj) -> list[str]:
    """Where the RayJob (less its pod templates) breaks KubeRay's schema: "path: message" each; [] when it passes."""
    schema = _schema()
    outline = copy.deepcopy(rayjob)
    for path, _ in pod_templates(outline):
        _set(outline, path, {})
    if outline.get("apiVersion") != schema["apiVersion"]:
        return [f"apiVersion: {outline.get('apiVersion')!r} is not {schema['apiVersion']!r}"]
    validator = jsonschema.Draft7Validator({key: value for key, value in schema.items() if key != "source"})
    return sorted(f"{'.'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
                  for error in validator.iter_errors(outline))


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


def _set(obj: Any, path: tuple[str | int, ...], value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value
