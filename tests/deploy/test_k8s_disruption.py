"""Voluntary disruptions wait for a running job (docs/kubernetes.md, Disruptions): every pod of every job asks the
cluster autoscaler and Karpenter to leave its node alone, and each job's PodDisruptionBudget lets no pod of that job,
and nothing else, be evicted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.support.job_pods import pod_labels, pod_templates, the_job
from tests.support.k8s_manifests import KUSTOMIZATIONS, PLAIN_DIR, REPO_ROOT, Obj, of_kind, render
from tests.support.network_policy import selects

RAYJOB_SOURCES = ("k8s/ray", "k8s/overlays/rayjob-streamed-data")
SOURCES = (PLAIN_DIR, *KUSTOMIZATIONS, *RAYJOB_SOURCES)
# What each autoscaler reads on a pod before it drains the pod's node of its own accord.
DO_NOT_DISRUPT = {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false", "karpenter.sh/do-not-disrupt": "true"}


@pytest.mark.parametrize("source", SOURCES)
def test_every_pod_of_the_job_asks_the_autoscalers_not_to_disrupt_its_node(source):
    for template in pod_templates(the_job(render(source))):
        annotations = template.get("metadata", {}).get("annotations", {})
        assert DO_NOT_DISRUPT.items() <= annotations.items(), template.get("metadata")


def renamed(source: str, tmp_path: Path) -> list[Obj]:
    """A second job of the same source in the same namespace, as docs/kubernetes.md has teams write it."""
    overlay = tmp_path / "second-job"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namePrefix": "team-a-",
        "resources": [os.path.relpath(REPO_ROOT / source, overlay)]}))
    return render(overlay.name, tmp_path)


def other_pods(objects: list[Obj]) -> list[dict[str, str]]:
    """The labels of the pods beside the job's own (the tracking overlay's MLflow server)."""
    return [obj["spec"]["template"]["metadata"].get("labels", {}) for obj in of_kind(objects, "Deployment")]


@pytest.mark.parametrize("source", (*KUSTOMIZATIONS, *RAYJOB_SOURCES))
def test_each_job_s_budget_holds_every_pod_of_that_job_and_no_other(source, tmp_path):
    first, second = render(source), renamed(source, tmp_path)
    for objects, other in ((first, second), (second, first)):
        (budget,) = of_kind(objects, "PodDisruptionBudget")
        # No pod may go, whatever replicas the overlay keeps; a count of pods would be wrong in some overlay.
        assert budget["spec"]["maxUnavailable"] == 0 and "minAvailable" not in budget["spec"]
        selector = budget["spec"]["selector"]
        own = pod_labels(the_job(objects))
        assert own and all(selects(selector, labels) for labels in own), (selector, own)
        others = pod_labels(the_job(other)) + other_pods(objects)
        assert not any(selects(selector, labels) for labels in others), (selector, others)
