"""The manifests under k8s/ as a cluster receives them, and the schemas they are checked against."""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
K8S_DIR = REPO_ROOT / "k8s"
# CI clones the repository with shared/ beside it.
SCHEMAS_DIR = REPO_ROOT.parent / "shared" / "schemas"

# What `kubectl apply -f k8s/` applies, and what each `kubectl apply -k` applies.
PLAIN_DIR = "k8s"
KUSTOMIZATIONS = ("k8s/base", "k8s/overlays/kind", "k8s/overlays/elastic", "k8s/overlays/gpu-single-node",
                  "k8s/overlays/gpu-multi-node", "k8s/trainer-v2")
SOURCES = (PLAIN_DIR, *KUSTOMIZATIONS)

# The custom resources' schemas, by (apiVersion, kind): the CRD files of the operators' releases.
CRD_FILES = {
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.yaml",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainer.kubeflow.org_trainjobs.yaml",
}

Obj = dict[str, Any]


def render(source: str) -> list[Obj]:
    """The objects `kubectl apply -f k8s/` (PLAIN_DIR) or `kubectl apply -k SOURCE` would send."""
    return copy.deepcopy(_render(source))


@functools.cache
def _render(source: str) -> list[Obj]:
    if source == PLAIN_DIR:
        # Removing a label nobody has: kubectl reads the folder exactly as `apply -f` does, offline
        # (--local), and prints the objects unchanged, one JSON document after another.
        cmd = ["kubectl", "label", "--local", "-o", "json", "-f", str(REPO_ROOT / source), "absent-label-"]
    else:
        cmd = ["kubectl", "kustomize", str(REPO_ROOT / source)]
    if shutil.which("kubectl") is None:
        raise AssertionError("kubectl not found on PATH: the manifests are rendered with it (a client, "
                             "1.27 or newer for its built-in kustomize v5)")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{out.stderr}")
    if source != PLAIN_DIR:
        return [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    objects, text = [], out.stdout.strip()
    while text:
        obj, end = json.JSONDecoder().raw_decode(text)
        objects.extend(obj["items"] if obj.get("kind") == "List" else [obj])
        text = text[end:].lstrip()
    return objects


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] == kind]


def config_maps(objects: list[Obj]) -> dict[str, dict[str, str]]:
    return {obj["metadata"]["name"]: obj.get("data", {}) for obj in of_kind(objects, "ConfigMap")}


def schemas_dir() -> Path:
    if not (SCHEMAS_DIR / CRD_FILES[("kubeflow.org/v1", "PyTorchJob")]).is_file():
        raise AssertionError(
            f"CRD schemas not found in {SCHEMAS_DIR}: the tests expect the shared/ folder beside the "
            f"repository (../shared/schemas), as CI clones it"
        )
    return SCHEMAS_DIR


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """The CRD's openAPIV3Schema, made strict: an object schema that lists its fields rejects others."""
    group, version = api_version.split("/")
    crd = yaml.safe_load((schemas_dir() / CRD_FILES[(api_version, kind)]).read_text())
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _strict(served["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def _strict(schema: Any) -> Any:
    """The API server prunes (or, with kubectl's field validation, rejects) fields a schema does not list."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        strict["additionalProperties"] = False
    return strict


def crd_errors(obj: Obj) -> list[str]:
    validator = crd_validator(obj["apiVersion"], obj["kind"])
    return [f"{'.'.join(map(str, error.absolute_path)) or '(root)'}: {error.message}"
            for error in validator.iter_errors(copy.deepcopy(obj))]
