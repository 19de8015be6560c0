"""Several jobs in one namespace: an overlay of any kustomization with a namePrefix and a nameSuffix renders a job
whose pods find its own ConfigMap, whose NetworkPolicy selects its own pods, and whose folder on the claim the
namespace's jobs share is its own (docs/kubernetes.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.support.job_pods import pod_templates
from tests.support.k8s_manifests import KUSTOMIZATIONS, REPO_ROOT, SHARED_CLAIM, Obj, render
from tests.support.k8s_operator import pod_plans
from tests.support.k8s_pods import pod_command
from tests.support.trainer_v2 import pod_plans as trainer_v2_pods

RAYJOB_SOURCES = ("k8s/ray", "k8s/overlays/rayjob-streamed-data")
PREFIX, SUFFIX = "team-a-", "-run2"
# The labels of one job's pods, the job's name among them: what each operator gives them; for a RayJob, what its
# templates give them (k8s/ray/networkpolicy.yaml says why).
JOB_LABELS = {"PyTorchJob": lambda name: {"training.kubeflow.org/job-name": name},
              "TrainJob": lambda name: {"jobset.sigs.k8s.io/jobset-name": name},
              "RayJob": lambda name: {"ray.io/originated-from-crd": "RayJob", "ray.io/originated-from-cr-name": name}}


def renamed(source: str, tmp_path: Path) -> list[Obj]:
    """`kubectl apply -k` on an overlay of ``source`` that only renames: what a second team would write."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namePrefix": PREFIX,
        "nameSuffix": SUFFIX, "resources": [os.path.relpath(REPO_ROOT / source, overlay)]}))
    return render(overlay.name, tmp_path)


@pytest.mark.parametrize("source", (*KUSTOMIZATIONS, *RAYJOB_SOURCES))
def test_a_renamed_job_refers_to_its_own_objects_and_isolates_its_own_pods(source, tmp_path):
    objects = renamed(source, tmp_path)
    names = {(obj["kind"], obj["metadata"]["name"]) for obj in objects}
    assert all(name.startswith(PREFIX) and name.endswith(SUFFIX) for _, name in names), names
    (job,) = [obj for obj in objects if obj["kind"] in ("PyTorchJob", "TrainJob", "RayJob")]
    for template in pod_templates(job):
        for volume in template["spec"].get("volumes", []):
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names, volume
            if "persistentVolumeClaim" in volume:
                # Its own claim (the RayJob's, the tracking overlay's MLflow server's), or the one the namespace's
                # jobs share, which k8s/storage applies apart from them and keeps its name.
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert ("PersistentVolumeClaim", claim) in names or claim == SHARED_CLAIM, volume
    if job["kind"] != "RayJob":  # its folder is --ray-run-name's, on a claim of its own (k8s/ray/pvc.yaml)
        for plan in (pod_plans if job["kind"] == "PyTorchJob" else trainer_v2_pods)(job):
            command = pod_command(plan)
            assert command[command.index("--output-dir") + 1] == f"/mnt/ddp/{job['metadata']['name']}", plan.name
    own_pods = {"matchLabels": JOB_LABELS[job["kind"]](job["metadata"]["name"])}
    for template in pod_templates(job):
        if job["kind"] == "RayJob":  # the operators of the others label the pods themselves
            assert own_pods["matchLabels"].items() <= template["metadata"]["labels"].items()
    for policy in (obj for obj in objects if obj["kind"] == "NetworkPolicy"):
        assert policy["spec"]["podSelector"] == own_pods
        assert policy["spec"]["ingress"][0] == {"from": [{"podSelector": own_pods}]}
