"""Kubeflow's custom resources checked against Kubeflow's own API models, which the dev extra installs.

``kubeflow-training`` 1.9.4 (PyTorchJob, openapi-generated classes) and ``kubeflow-trainer-api`` 2.3.0
(TrainJob, pydantic models) declare every field of every object, with its type and whether it is
required. A manifest is read into its model and written back out: a field the model does not declare
does not come back (the API server would drop it, or refuse it under field validation), a value that
comes back changed had the wrong type, and a missing required field or an unreadable value fails the
read. The pod templates inside a PyTorchJob are Kubernetes' own type; tests/deploy/test_k8s_manifests.py
checks them against Kubernetes' schema with kubernetes-validate, which lets two env entries of one name pass: the
PyTorchJob's CRD refuses them (below).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import kubeflow.training
import pydantic
from kubeflow_trainer_api import models as trainer_v2

from tests.support.structural_schema import duplicates

Obj = dict[str, Any]


def api_errors(obj: Obj) -> list[str]:
    """What the object's Kubeflow API model rejects; [] when it passes. KeyError for other kinds."""
    return CHECKS[(obj["apiVersion"], obj["kind"])](obj)


def _pytorchjob_errors(job: Obj) -> list[str]:
    return _duplicate_env_names(job) + _pytorchjob_model_errors(job)


# training-operator v1.9.4's CRD (manifests/base/crds/kubeflow.org_pytorchjobs.yaml) makes each container's env a
# list map keyed by name (x-kubernetes-list-type: map), and the API server refuses a second entry of one name; the
# Python models know nothing of list types. The CRD marks other lists of the pod (volumes, ports, volumeMounts) too:
# the manifests' are not patched by more than one component.
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


def _duplicate_env_names(job: Obj) -> list[str]:
    problems = []
    for rtype, replica in job.get("spec", {}).get("pytorchReplicaSpecs", {}).items():
        pod = replica.get("template", {}).get("spec", {}) if isinstance(replica, dict) else {}
        for kind in CONTAINER_LISTS:
            for index, container in enumerate(pod.get(kind) or []):
                where = f"spec.pytorchReplicaSpecs.{rtype}.template.spec.{kind}.{index}.env"
                problems += [f"{where}.{item}: {message}"
                             for item, message in duplicates(container.get("env") or [], ["name"])]
    return problems


def _pytorchjob_model_errors(job: Obj) -> list[str]:
    outline = copy.deepcopy(job)
    for replica in outline.get("spec", {}).get("pytorchReplicaSpecs", {}).values():
        if isinstance(replica, dict) and "template" in replica:
            replica["template"] = {}  # Kubernetes' PodTemplateSpec: checked with Kubernetes' own schema
    client = kubeflow.training.ApiClient()
    try:
        model = client.deserialize(_Response(outline), "KubeflowOrgV1PyTorchJob")
    except (ValueError, TypeError) as error:
        return [f"(read) {error}"]
    return differences(outline, client.sanitize_for_serialization(model))


def _trainjob_errors(trainjob: Obj) -> list[str]:
    try:
        model = trainer_v2.TrainerV1alpha1TrainJob.from_dict(copy.deepcopy(trainjob))
    except (pydantic.ValidationError, ValueError, TypeError) as error:
        return [f"(read) {' '.join(str(error).split())}"]
    if model is None:
        return ["(read) the TrainJob model read nothing"]
    return differences(trainjob, model.to_dict())


class _Response:
    """What kubeflow.training's ApiClient.deserialize reads: an HTTP response's JSON body."""

    def __init__(self, obj: Obj) -> None:
        self.data = json.dumps(obj)


def differences(given: Any, read_back: Any, path: str = "") -> list[str]:
    """Where read_back, the model's view of given, lost a field or changed a value."""
    where = path or "(root)"
    if isinstance(given, dict):
        if not isinstance(read_back, dict):
            return [f"{where}: an object where the API declares {type(read_back).__name__}"]
        problems = []
        for key, value in given.items():
            inner = f"{path}.{key}" if path else key
            if key not in read_back:
                problems.append(f"{inner}: not a field of this object")
            else:
                problems += differences(value, read_back[key], inner)
        return problems
    if isinstance(given, list):
        if not isinstance(read_back, list) or len(read_back) != len(given):
            return [f"{where}: a list where the API declares {type(read_back).__name__}"]
        return [problem for index, (item, back) in enumerate(zip(given, read_back, strict=True))
                for problem in differences(item, back, f"{path}.{index}")]
    if _same_json_value(given, read_back):
        return []
    return [f"{where}: {given!r} has the wrong type (the API reads it as {read_back!r})"]


def _same_json_value(given: Any, read_back: Any) -> bool:
    """JSON has one kind of number (a quantity's 2 may come back as 2.0); true and 1 are not alike."""
    def number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if number(given) and number(read_back):
        return given == read_back
    return type(given) is type(read_back) and given == read_back


CHECKS: dict[tuple[str, str], Callable[[Obj], list[str]]] = {
    ("kubeflow.org/v1", "PyTorchJob"): _pytorchjob_errors,
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): _trainjob_errors,
}
