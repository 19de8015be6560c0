"""Images from a registry that asks for credentials: k8s/components/pull-secret gives the pull secret to every pod
of every kind of job, renamed jobs included, through the job's ServiceAccount (docs/kubernetes.md, Images)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.support.job_pods import pod_templates, the_job
from tests.support.k8s_manifests import KUSTOMIZATIONS, REPO_ROOT, Obj, render

RAYJOB_SOURCES = ("k8s/ray", "k8s/overlays/rayjob-streamed-data")
COMPONENT = REPO_ROOT / "k8s" / "components" / "pull-secret"


def overlay_of(source: str, tmp_path: Path, *, with_component: bool, name_prefix: str = "") -> list[Obj]:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    kustomization: Obj = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                          "resources": [os.path.relpath(REPO_ROOT / source, overlay)]}
    if with_component:
        kustomization["components"] = [os.path.relpath(COMPONENT, overlay)]
    if name_prefix:
        kustomization["namePrefix"] = name_prefix
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(overlay.name, tmp_path)


def pull_secrets_as_admitted(template: Obj, objects: list[Obj]) -> list[Obj]:
    """The pod's pull secrets once the API server's ServiceAccount admission has run: the pod is refused unless its
    account exists, and gets the account's imagePullSecrets when it names none of its own."""
    account_name = template["spec"].get("serviceAccountName", "default")
    accounts = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "ServiceAccount"}
    assert account_name in accounts, f"the pod names ServiceAccount {account_name}, which the job does not create"
    return template["spec"].get("imagePullSecrets") or accounts[account_name].get("imagePullSecrets", [])


@pytest.mark.parametrize("source", (*KUSTOMIZATIONS, *RAYJOB_SOURCES))
def test_the_component_gives_every_pod_of_the_job_the_registry_s_pull_secret(source, tmp_path):
    objects = overlay_of(source, tmp_path, with_component=True, name_prefix="team-a-")
    templates = pod_templates(the_job(objects))
    assert templates
    for template in templates:
        # The Secret is the namespace's, not the job's: a renamed job keeps using it.
        assert pull_secrets_as_admitted(template, objects) == [{"name": "registry-credentials"}], template["metadata"]


@pytest.mark.parametrize("source", ("k8s/base", "k8s/trainer-v2", "k8s/ray"))
def test_without_the_component_no_pod_asks_for_a_pull_secret(source, tmp_path):
    objects = overlay_of(source, tmp_path, with_component=False)
    for template in pod_templates(the_job(objects)):
        assert pull_secrets_as_admitted(template, objects) == []


def test_kubectl_apply_of_the_folder_creates_the_account_before_the_job_that_names_it():
    """`kubectl apply -f k8s/` applies the files in name order; a pod naming an account that does not exist yet is
    refused by the API server, so the account's file must sort first."""
    kinds = {path.name: [document["kind"] for document in yaml.safe_load_all(path.read_text()) if document]
             for path in sorted((REPO_ROOT / "k8s").glob("*.yaml"))}
    order = list(kinds)
    account = next(name for name, found in kinds.items() if "ServiceAccount" in found)
    job = next(name for name, found in kinds.items() if "PyTorchJob" in found)
    assert order.index(account) < order.index(job), order
