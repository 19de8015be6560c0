"""The shared claim's storage class as a parameter: each cloud's component (k8s/components/rwx-storage-*) in an overlay
of every kustomization, renamed too, sets a ReadWriteMany class of that cloud on the claim every pod mounts, and on no
other claim (the tracking overlay's MLflow claim keeps the cluster's default)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.support.k8s_manifests import K8S_DIR, REPO_ROOT, Obj, of_kind, render

# Each cloud's file-share class, from its provider's documentation: GKE's Filestore CSI driver installs standard-rwx
# (and premium-rwx, enterprise-rwx); EKS's is the one the EFS CSI driver's guide has users create, efs-sc; AKS has
# azurefile-csi (and azurefile-csi-premium) built in. Their block-storage defaults are ReadWriteOnce only.
CLASSES = {"rwx-storage-gke-filestore": "standard-rwx", "rwx-storage-eks-efs": "efs-sc",
           "rwx-storage-aks-azurefile": "azurefile-csi"}
SHARED_CLAIM = "ddp-train-storage"
PREFIX = "team-a-"
# One of each kind of job, and the tracking overlay, whose MLflow server has a claim of its own.
SOURCES = ("k8s/base", "k8s/overlays/gpu-multi-node", "k8s/overlays/tracking", "k8s/trainer-v2", "k8s/ray")


def with_component(source: str, component: str, tmp_path: Path, prefix: str = "") -> list[Obj]:
    """`kubectl apply -k` on an overlay of `source` that adds the component (and a namePrefix): what a user writes."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": [os.path.relpath(REPO_ROOT / source, overlay)],
                     "components": [os.path.relpath(K8S_DIR / "components" / component, overlay)]}
    if prefix:
        kustomization["namePrefix"] = prefix
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(overlay.name, tmp_path)


def claim_names_mounted(objects: list[Obj]) -> set[str]:
    """Every claim a pod template of the objects mounts, wherever the template sits in its job."""
    found: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if "persistentVolumeClaim" in node:
                found.add(node["persistentVolumeClaim"]["claimName"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk([obj for obj in objects if obj["kind"] != "PersistentVolumeClaim"])
    return found


@pytest.mark.parametrize("component", sorted(CLASSES))
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("prefix", ["", PREFIX])
def test_the_component_gives_the_shared_claim_its_clouds_rwx_class_and_touches_no_other(source, component, prefix,
                                                                                      tmp_path):
    objects = with_component(source, component, tmp_path, prefix)
    claims = {claim["metadata"]["name"]: claim for claim in of_kind(objects, "PersistentVolumeClaim")}
    shared = claims.pop(prefix + SHARED_CLAIM)
    assert shared["spec"]["storageClassName"] == CLASSES[component]
    assert shared["spec"]["accessModes"] == ["ReadWriteMany"], "pods on several nodes mount it"
    assert prefix + SHARED_CLAIM in claim_names_mounted(objects), "the pods mount the claim the class was set on"
    for name, claim in claims.items():
        assert "storageClassName" not in claim["spec"], name


def test_without_a_component_the_claim_names_no_class():
    (claim,) = [claim for claim in of_kind(render("k8s/base"), "PersistentVolumeClaim")
                if claim["metadata"]["name"] == SHARED_CLAIM]
    assert "storageClassName" not in claim["spec"], "the cluster's default, which must then offer ReadWriteMany"
