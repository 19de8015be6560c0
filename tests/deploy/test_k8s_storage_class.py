"""The shared claim's storage class as a parameter: each cloud's component (k8s/components/rwx-storage-*) sets a
ReadWriteMany class of that cloud on the claim the jobs share (k8s/storage, and k8s/storage/{gke,eks,aks} with it),
on the RayJob's own claim, renamed too, and on no other claim (the tracking overlay's MLflow claim keeps the
cluster's default); the jobs' pods mount the claim it was set on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.k8s_manifests import KUSTOMIZATIONS, SHARED_CLAIM, Obj, of_kind, render, user_overlay

# Each cloud's file-share class, from its provider's documentation: GKE's Filestore CSI driver installs standard-rwx
# (and premium-rwx, enterprise-rwx); EKS's is the one the EFS CSI driver's guide has users create, efs-sc; AKS has
# azurefile-csi (and azurefile-csi-premium) built in. Their block-storage defaults are ReadWriteOnce only.
CLASSES = {"rwx-storage-gke-filestore": "standard-rwx", "rwx-storage-eks-efs": "efs-sc",
           "rwx-storage-aks-azurefile": "azurefile-csi"}
PREFIX = "team-a-"
RAYJOB_CLAIM = "ddp-train-storage"  # k8s/ray/pvc.yaml: in the RayJob's own set
# Where each claim is: the shared one's folder, the RayJob with its own, and the tracking overlay, whose MLflow
# server has a claim of its own and mounts the shared one too.
SOURCES = {"k8s/storage/claim": SHARED_CLAIM, "k8s/ray": RAYJOB_CLAIM, "k8s/overlays/tracking": None}
CLOUD_FOLDERS = {"k8s/storage/gke": "rwx-storage-gke-filestore", "k8s/storage/eks": "rwx-storage-eks-efs",
                 "k8s/storage/aks": "rwx-storage-aks-azurefile"}


def with_component(source: str, component: str, tmp_path: Path, prefix: str = "") -> list[Obj]:
    return user_overlay(tmp_path, source, [component], prefix)


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
@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("prefix", ["", PREFIX])
def test_the_component_gives_the_shared_claim_its_clouds_rwx_class_and_touches_no_other(source, component, prefix,
                                                                                      tmp_path):
    objects = with_component(source, component, tmp_path, prefix)
    claims = {claim["metadata"]["name"]: claim for claim in of_kind(objects, "PersistentVolumeClaim")}
    if SOURCES[source] is not None:
        shared = claims.pop(prefix + SOURCES[source])
        assert shared["spec"]["storageClassName"] == CLASSES[component]
        assert shared["spec"]["accessModes"] == ["ReadWriteMany"], "pods on several nodes mount it"
    for name, claim in claims.items():
        assert "storageClassName" not in claim["spec"], name


@pytest.mark.parametrize("folder", sorted(CLOUD_FOLDERS))
def test_each_clouds_storage_folder_is_the_shared_claim_with_its_component(folder, tmp_path):
    assert render(folder) == with_component("k8s/storage/claim", CLOUD_FOLDERS[folder], tmp_path)


@pytest.mark.parametrize("source", [*KUSTOMIZATIONS, "k8s/ray"])
def test_every_jobs_pods_mount_a_claim_a_component_sets_the_class_of(source):
    mounted = claim_names_mounted(render(source))
    assert mounted, source
    assert mounted <= {SHARED_CLAIM, RAYJOB_CLAIM, "mlflow"}, (source, mounted)


def test_without_a_component_the_claim_names_no_class():
    (claim,) = of_kind(render("k8s/storage/claim"), "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == SHARED_CLAIM
    assert "storageClassName" not in claim["spec"], "the cluster's default, which must then offer ReadWriteMany"
