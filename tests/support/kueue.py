"""What Kueue does with a job and its queue objects, for tests without a cluster.

Transcribed from kubernetes-sigs/kueue at tag v0.19.2: the job webhooks' refusals from
pkg/controller/jobframework/validation.go, pkg/controller/jobs/rayjob/rayjob_webhook.go and
pkg/controller/jobs/raycluster/common.go (ValidateCreate); the pod sets a job is admitted as from each integration's
PodSets (kubeflow/kubeflowjob, trainjob, rayjob with raycluster's BuildPodSets); the queue objects' schemas from
config/components/crd/bases (tests/fixtures/kueue-v0.19.2-*.schema.json, made by scripts/crd_schema.py), with the
ClusterQueue rules its CRD states in CEL and its webhook (pkg/webhooks/clusterqueue_webhook.go) adds, which a JSON
schema cannot say.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.processes import REPO_ROOT
from tests.support.k8s_pods import QUANTITY_SUFFIXES
from tests.support.structural_schema import crd_errors, fixture_schema
from tests.support.trainer_v2 import pod_plans as trainer_v2_pods

Obj = dict[str, Any]
RELEASE = "v0.19.2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"
# Kueue's workload-slicing (elastic) jobs: batch Jobs and Ray's; a PyTorchJob or TrainJob that asks is refused.
ELASTIC_KINDS = ("Job", "RayCluster", "RayJob", "RayService")
MAX_POD_SETS = 18  # jobframework.MaxPodSets: a Workload holds at most this many
RAY_HEAD_POD_SET = "head"  # raycluster's headGroupPodSetName: no worker group may take it
# The API server's IsDNS1123Subdomain, which Kueue applies to the queue-name label's value.
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# Where each kind keeps the field Kueue's webhook sets at creation and clears at admission.
SUSPEND_FIELD = {"PyTorchJob": ("spec", "runPolicy", "suspend"), "TrainJob": ("spec", "suspend"),
                 "RayJob": ("spec", "suspend")}


def schema_path(kind: str) -> Path:
    return REPO_ROOT / "tests" / "fixtures" / f"kueue-{RELEASE}-{kind.lower()}.schema.json"


def queue_object_errors(obj: Obj) -> list[str]:
    """Where a queue object breaks Kueue's API: its CRD's schema, and for a ClusterQueue the rule that each flavor
    quotes every covered resource, by name and in order."""
    path = schema_path(obj["kind"])
    errors = crd_errors(obj, path)
    if obj.get("apiVersion") != fixture_schema(path)["apiVersion"]:
        return errors  # the wrong API altogether: its fields are not worth reading
    for group_index, group in enumerate(obj.get("spec", {}).get("resourceGroups", [])):
        for flavor_index, flavor in enumerate(group.get("flavors", [])):
            names = [resource.get("name") for resource in flavor.get("resources", [])]
            if names != group.get("coveredResources"):
                errors.append(f"spec.resourceGroups.{group_index}.flavors.{flavor_index}.resources: {names} must "
                              f"match the names in coveredResources, {group.get('coveredResources')}")
    return errors


def webhook_errors(job: Obj) -> list[str]:
    """What Kueue's webhook refuses of a job it manages (one with a queue-name label): each one means `kubectl
    apply` fails. Only the rules that need no cluster state (not the topology requests)."""
    labels = job["metadata"].get("labels", {})
    annotations = job["metadata"].get("annotations", {})
    if QUEUE_LABEL not in labels:
        return []
    errors = []
    queue = labels[QUEUE_LABEL]
    if not DNS1123_SUBDOMAIN.match(queue) or len(queue) > 253:
        errors.append(f"metadata.labels[{QUEUE_LABEL}]: Invalid value: {queue!r}: not a DNS-1123 subdomain")
    if annotations.get(ELASTIC_ANNOTATION) == "true" and job["kind"] not in ELASTIC_KINDS:
        errors.append(f"metadata.annotations[{ELASTIC_ANNOTATION}]: Forbidden: elastic job is not supported for "
                      f"{job['kind']}")
    if job["kind"] == "RayJob":
        errors += _rayjob_errors(job, elastic=annotations.get(ELASTIC_ANNOTATION) == "true")
    return errors


def _rayjob_errors(job: Obj, elastic: bool) -> list[str]:
    spec = job["spec"]
    cluster = spec.get("rayClusterSpec")
    if spec.get("clusterSelector"):
        return (["spec.clusterSelector: Invalid value: a kueue managed job should not use an existing cluster"]
                if cluster is not None else [])  # a job on an existing cluster is not Kueue's to manage
    if cluster is None:
        return ["spec.rayClusterSpec: Required value: rayClusterSpec is required for Kueue-managed jobs that don't "
                "use clusterSelector"]
    errors = []
    if not spec.get("shutdownAfterJobFinishes", False):
        errors.append("spec.shutdownAfterJobFinishes: Invalid value: false: a kueue managed job should delete the "
                      "cluster after finishing")
    if cluster.get("enableInTreeAutoscaling", False) and not elastic:
        errors.append("spec.rayClusterSpec.enableInTreeAutoscaling: Invalid value: true: a kueue managed job should "
                      "only use autoscaling when workload slicing is enabled")
    if len(cluster.get("workerGroupSpecs", [])) + 1 > MAX_POD_SETS:
        errors.append(f"spec.rayClusterSpec.workerGroupSpecs: Too many: must have at most {MAX_POD_SETS} items")
    errors += [f"spec.rayClusterSpec.workerGroupSpecs[{index}].groupName: Forbidden: {RAY_HEAD_POD_SET!r} is reserved "
               f"for the head group" for index, group in enumerate(cluster.get("workerGroupSpecs", []))
               if group.get("groupName") == RAY_HEAD_POD_SET]
    return errors


@dataclass(frozen=True)
class PodSet:
    """One group of identical pods of a Workload: Kueue admits a job's pod sets together, or none of them."""

    name: str
    count: int
    template: Obj


# KubeRay's default submitter pod (rayjob_controller.go's defaultSubmitterResources), when a K8sJobMode RayJob
# gives none of its own.
RAY_DEFAULT_SUBMITTER = {"spec": {"containers": [{"name": "ray-job-submitter", "resources": {
    "requests": {"cpu": "500m", "memory": "200Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}}]}}


def pod_sets(job: Obj) -> list[PodSet]:
    """The pod sets Kueue makes of a job, in its order: what it reserves quota for."""
    spec = job["spec"]
    if job["kind"] == "PyTorchJob":
        # Kueue reads replicas, never elasticPolicy: an elastic job is admitted at Worker.replicas.
        replicas = spec["pytorchReplicaSpecs"]
        return [PodSet(rtype, replicas[rtype].get("replicas", 1), replicas[rtype]["template"])
                for rtype in ("Master", "Worker") if rtype in replicas]
    if job["kind"] == "TrainJob":
        # The JobSet Trainer makes of the torch-distributed runtime: one replicated job, a pod per node.
        nodes = trainer_v2_pods(job)
        return [PodSet(nodes[0].replica_type, len(nodes), nodes[0].template)]
    cluster = spec["rayClusterSpec"]
    sets = [PodSet(RAY_HEAD_POD_SET, 1, cluster["headGroupSpec"]["template"])]
    sets += [PodSet(group["groupName"], group.get("replicas", 1) * max(group.get("numOfHosts", 1), 1),
                    group["template"]) for group in cluster.get("workerGroupSpecs", [])]
    if spec.get("submissionMode") == "K8sJobMode":
        sets.append(PodSet("submitter", 1, spec.get("submitterPodTemplate", RAY_DEFAULT_SUBMITTER)))
    return sets


def pod_requests(template: Obj) -> dict[str, float]:
    """One pod's requests as Kueue counts them: each container's (its limit where it requests nothing, as the API
    server defaults it), summed, and no less than any init container's; plus the pod's overhead."""
    def of(container: Obj) -> dict[str, float]:
        resources = container.get("resources", {})
        return {name: quantity(value)
                for name, value in {**resources.get("limits", {}), **resources.get("requests", {})}.items()}
    spec = template["spec"]
    total: dict[str, float] = {}
    for container in spec.get("containers", []):
        for name, value in of(container).items():
            total[name] = total.get(name, 0.0) + value
    for container in spec.get("initContainers", []):
        for name, value in of(container).items():
            total[name] = max(total.get(name, 0.0), value)
    for name, value in spec.get("overhead", {}).items():
        total[name] = total.get(name, 0.0) + quantity(value)
    return total


def job_requests(job: Obj) -> dict[str, float]:
    """What the whole job needs of its ClusterQueue's quota to be admitted."""
    total: dict[str, float] = {}
    for pod_set in pod_sets(job):
        for name, value in pod_requests(pod_set.template).items():
            total[name] = total.get(name, 0.0) + pod_set.count * value
    return total


def quantity(value: str | int | float) -> float:
    text = str(value)
    suffix = next((s for s in sorted(QUANTITY_SUFFIXES, key=len, reverse=True) if text.endswith(s)), "")
    return float(text.removesuffix(suffix)) * QUANTITY_SUFFIXES.get(suffix, 1)
