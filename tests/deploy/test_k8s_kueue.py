"""Queueing with Kueue (docs/kubernetes.md, "Queueing with Kueue"): k8s/components/kueue over every variant, as a
user's overlay renders it, and the queue objects of k8s/kueue, checked against Kueue v0.19.2 (tests/support/kueue.py):
its CRDs' schemas, its job webhooks' rules, the pod sets it admits a job as, and what its TrainJob integration writes
back; each job also still against its own operator's API."""

from __future__ import annotations

import copy
import os

import kubernetes_validate
import pytest
import yaml

from devtools.processes import REPO_ROOT
from tests.deploy.test_k8s_spot import MARGIN_S, checkpoint_config
from tests.support import kueue
from tests.support.job_pods import the_job
from tests.support.k8s_manifests import K8S_DIR, KUSTOMIZATIONS, TRAINJOB_SOURCES, Obj, of_kind, render, user_overlay
from tests.support.k8s_operator import admission_errors as operator_admission_errors
from tests.support.kubeflow_api import api_errors
from tests.support.kuberay_api import pod_template_errors, rayjob_errors
from tests.support.trainer_crds import crd_errors
from tests.support.trainer_v2 import admission_errors as trainer_admission_errors
from tests.support.trainer_v2 import pod_plans as trainer_v2_pods

COMPONENT = "kueue"
QUEUE_DIR = K8S_DIR / "kueue"
JOB_SOURCES = (*KUSTOMIZATIONS, "k8s/ray", "k8s/overlays/rayjob-streamed-data")
QUEUE, PRIORITY = "ddp-deploy", "ddp-deploy-batch"  # what the component names
# Kubernetes' terminationGracePeriodSeconds when a pod gives none.
KUBERNETES_DEFAULT_GRACE_S = 30
NODE_POD = "spec.runtimePatches.0.trainingRuntimeSpec.template.spec.replicatedJobs.0.template.spec.template.spec"


def queue_objects() -> list[Obj]:
    """What `kubectl apply -f k8s/kueue/` sends: every document of every file, in name order."""
    return [doc for path in sorted(QUEUE_DIR.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def named(kind: str) -> set[str]:
    return {obj["metadata"]["name"] for obj in queue_objects() if obj["kind"] == kind}


def without_kueue_labels(objects: list[Obj]) -> list[Obj]:
    objects = copy.deepcopy(objects)
    for obj in objects:
        labels = obj["metadata"].get("labels", {})
        for key in (kueue.QUEUE_LABEL, kueue.PRIORITY_LABEL):
            labels.pop(key, None)
    return objects


def operator_errors(job: Obj) -> list[str]:
    """What the job's own operator refuses of it: its API's schema and its webhook."""
    if job["kind"] == "PyTorchJob":
        return api_errors(job) + operator_admission_errors(job)
    if job["kind"] == "TrainJob":
        return crd_errors(job, "v2.3.0") + api_errors(job) + trainer_admission_errors(job)
    return rayjob_errors(job) + pod_template_errors(job, kubernetes_validate.latest_version())


def admitted_trainjob(trainjob: Obj) -> Obj:
    """The TrainJob as Kueue's TrainJob integration leaves it once admitted: its webhook appended a runtime patch of
    its own, which admission fills with each pod set's node selector (the flavor's nodeLabels: none here)."""
    trainjob = copy.deepcopy(trainjob)
    trainjob["spec"].setdefault("runtimePatches", []).append({
        "manager": "kueue.x-k8s.io/manager",
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
            {"name": pod_set.name, "template": {"spec": {"template": {"spec": {"nodeSelector": {}}}}}}
            for pod_set in kueue.pod_sets(trainjob)]}}}})
    return trainjob


def test_the_queue_objects_pass_kueues_schemas_and_name_each_other():
    objects = queue_objects()
    assert sorted(obj["kind"] for obj in objects) == sorted(
        ["ResourceFlavor", "ClusterQueue", "LocalQueue", "WorkloadPriorityClass", "WorkloadPriorityClass"])
    for obj in objects:
        assert kueue.queue_object_errors(obj) == [], f"{obj['kind']} {obj['metadata']['name']}"
    (cluster_queue,) = of_kind(objects, "ClusterQueue")
    for group in cluster_queue["spec"]["resourceGroups"]:
        assert {flavor["name"] for flavor in group["flavors"]} <= named("ResourceFlavor")
    (local_queue,) = of_kind(objects, "LocalQueue")
    assert local_queue["spec"]["clusterQueue"] == cluster_queue["metadata"]["name"]
    assert "namespace" not in local_queue["metadata"], "applied in the jobs' own namespace"
    values = {obj["metadata"]["name"]: obj["value"] for obj in of_kind(objects, "WorkloadPriorityClass")}
    assert values[PRIORITY] < values["ddp-deploy-urgent"], "an urgent job preempts a batch one, not the reverse"
    assert cluster_queue["spec"]["preemption"]["withinClusterQueue"] == "LowerPriority"


@pytest.mark.parametrize("source", JOB_SOURCES)
def test_the_component_queues_the_job_on_its_own_metadata_and_changes_nothing_else(source, tmp_path):
    objects = user_overlay(tmp_path, source, [COMPONENT])
    job = the_job(objects)
    labels = job["metadata"]["labels"]
    assert (labels.get(kueue.QUEUE_LABEL), labels.get(kueue.PRIORITY_LABEL)) == (QUEUE, PRIORITY), job["kind"]
    assert labels[kueue.QUEUE_LABEL] in named("LocalQueue") and labels[kueue.PRIORITY_LABEL] in named(
        "WorkloadPriorityClass")
    # On a pod template they would be Kueue's pod integration's business, not the job's.
    assert not any({kueue.QUEUE_LABEL, kueue.PRIORITY_LABEL} & set(pod_set.template.get("metadata", {}).get(
        "labels", {})) for pod_set in kueue.pod_sets(job))
    assert kueue.webhook_errors(job) == []
    assert operator_errors(job) == []
    # Kueue's webhook suspends the job at creation and its controller unsuspends it at admission: a manifest's own
    # value would unsuspend it behind Kueue's back at the next kubectl apply.
    value = job
    for key in kueue.SUSPEND_FIELD[job["kind"]]:
        value = value.get(key, {})
    assert value == {}, f"{job['kind']} sets {'.'.join(kueue.SUSPEND_FIELD[job['kind']])}: {value!r}"
    if job["kind"] == "TrainJob":
        assert trainer_admission_errors(admitted_trainjob(job)) == [], "Trainer's webhook takes Kueue's own patch"
        assert crd_errors(admitted_trainjob(job), "v2.3.0") == []
    assert without_kueue_labels(objects) == render(source), "the labels are the component's only change"


@pytest.mark.parametrize("source", JOB_SOURCES)
def test_without_the_component_no_job_names_a_queue(source):
    job = the_job(render(source))
    assert not {kueue.QUEUE_LABEL, kueue.PRIORITY_LABEL} & set(job["metadata"].get("labels", {}))


def test_ones_own_overlay_moves_the_job_to_another_queue_and_priority(tmp_path):
    folder = tmp_path / "overlay"
    folder.mkdir()
    patches = [{"target": {"labelSelector": label}, "patch": yaml.safe_dump(
        [{"op": "replace", "path": f"/metadata/labels/{label.replace('/', '~1')}", "value": value}])}
        for label, value in ((kueue.QUEUE_LABEL, "team-a"), (kueue.PRIORITY_LABEL, "ddp-deploy-urgent"))]
    for source in ("k8s/base", "k8s/trainer-v2", "k8s/ray"):
        (folder / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(REPO_ROOT / source, folder)],
            "components": [os.path.relpath(K8S_DIR / "components" / COMPONENT, folder)], "patches": patches}))
        labels = the_job(render(folder.name, tmp_path))["metadata"]["labels"]
        assert (labels[kueue.QUEUE_LABEL], labels[kueue.PRIORITY_LABEL]) == ("team-a", "ddp-deploy-urgent"), source


@pytest.mark.parametrize("source", JOB_SOURCES)
def test_every_job_fits_the_example_cluster_queue_whole(source):
    """Kueue admits all of a job's pod sets or none: their requests must fit the quota together, and each resource
    they request must be one the ClusterQueue covers, or the job is never admitted."""
    (cluster_queue,) = of_kind(queue_objects(), "ClusterQueue")
    (group,) = cluster_queue["spec"]["resourceGroups"]
    (flavor,) = group["flavors"]
    quota = {resource["name"]: kueue.quantity(resource["nominalQuota"]) for resource in flavor["resources"]}
    job = the_job(render(source))
    pod_sets = kueue.pod_sets(job)
    assert len(pod_sets) <= kueue.MAX_POD_SETS
    needed = kueue.job_requests(job)
    assert set(needed) <= set(group["coveredResources"]), f"not covered: {set(needed) - set(group['coveredResources'])}"
    assert all(value <= quota[name] for name, value in needed.items()), (needed, quota)
    elastic = job["spec"].get("elasticPolicy")
    if elastic:
        # Kueue reads Worker.replicas, not the elastic bounds: the job holds quota for its largest size.
        (workers,) = [pod_set for pod_set in pod_sets if pod_set.name == "Worker"]
        assert workers.count == elastic["maxReplicas"]


@pytest.mark.parametrize("source", TRAINJOB_SOURCES)
def test_kueue_v0_19_writes_a_trainjob_back_without_its_grace_period_and_the_trainers_bound_still_fits(source,
                                                                                                     tmp_path):
    """Kueue v0.19.2 is built on Trainer's v2.2.1 API (its go.mod), and at admission and preemption it writes the
    whole TrainJob back (trainjob_controller.go: c.Update): a field that API lacks is dropped. Of these TrainJobs
    that is the runtime patch's terminationGracePeriodSeconds alone, so their pods get Kubernetes' 30 s, which
    the trainer's own bound must fit with its margin."""
    objects = render(source)
    (trainjob,) = of_kind(objects, "TrainJob")
    assert crd_errors(trainjob, "v2.2.1") == [
        f"{NODE_POD}: Additional properties are not allowed ('terminationGracePeriodSeconds' was unexpected)"]
    written_back = copy.deepcopy(trainjob)
    for patch in written_back["spec"]["runtimePatches"]:
        for job in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            job["template"]["spec"]["template"]["spec"].pop("terminationGracePeriodSeconds", None)
    assert crd_errors(written_back, "v2.2.1") == []
    for plan in trainer_v2_pods(written_back):
        pod_grace_s = plan.template["spec"].get("terminationGracePeriodSeconds", KUBERNETES_DEFAULT_GRACE_S)
        trainer_grace_s = checkpoint_config(objects, plan, tmp_path).grace_period_s
        assert trainer_grace_s + MARGIN_S <= pod_grace_s, f"{plan.name}: --grace-period-s {trainer_grace_s:g}"


@pytest.mark.parametrize(("source", "change", "error"), [
    ("k8s/ray", lambda job: job["spec"].update(shutdownAfterJobFinishes=False),
     "spec.shutdownAfterJobFinishes: Invalid value: false: a kueue managed job should delete the cluster after "
     "finishing"),
    ("k8s/ray", lambda job: job["spec"].update(clusterSelector={"ray.io/cluster": "shared"}),
     "spec.clusterSelector: Invalid value: a kueue managed job should not use an existing cluster"),
    ("k8s/ray", lambda job: job["spec"]["rayClusterSpec"].update(enableInTreeAutoscaling=True),
     "spec.rayClusterSpec.enableInTreeAutoscaling: Invalid value: true: a kueue managed job should only use "
     "autoscaling when workload slicing is enabled"),
    ("k8s/ray", lambda job: job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(groupName="head"),
     "spec.rayClusterSpec.workerGroupSpecs[0].groupName: Forbidden: 'head' is reserved for the head group"),
    ("k8s/overlays/elastic", lambda job: job["metadata"].setdefault("annotations", {}).update(
        {kueue.ELASTIC_ANNOTATION: "true"}),
     "metadata.annotations[kueue.x-k8s.io/elastic-job]: Forbidden: elastic job is not supported for PyTorchJob"),
    ("k8s/trainer-v2", lambda job: job["metadata"]["labels"].update({kueue.QUEUE_LABEL: "Team_A"}),
     "metadata.labels[kueue.x-k8s.io/queue-name]: Invalid value: 'Team_A': not a DNS-1123 subdomain"),
])
def test_kueues_webhook_refuses_what_it_refuses_of_a_queued_job(source, change, error):
    job = the_job(render(source))
    job["metadata"]["labels"][kueue.QUEUE_LABEL] = QUEUE
    change(job)
    assert kueue.webhook_errors(job) == [error]


def test_a_job_without_the_queue_label_is_not_kueues_to_refuse():
    (job,) = of_kind(render("k8s/ray"), "RayJob")
    job["spec"]["shutdownAfterJobFinishes"] = False
    assert kueue.webhook_errors(job) == []


@pytest.mark.parametrize(("kind", "path", "change", "error"), [
    ("ClusterQueue", ("spec",), {"queueingStrategy": "LIFO"}, "spec.queueingStrategy: 'LIFO' is not one of"),
    ("ClusterQueue", ("spec", "resourceGroups", 0, "flavors", 0, "resources", 0), {"name": "memory"},
     "spec.resourceGroups.0.flavors.0.resources: ['memory', 'memory', 'ephemeral-storage', 'nvidia.com/gpu'] must "
     "match the names in coveredResources"),
    ("LocalQueue", ("spec",), {"clusterQueue": "Team_A"}, "spec.clusterQueue: 'Team_A' does not match"),
    ("WorkloadPriorityClass", (), {"valu": 1}, "'valu' was unexpected"),
])
def test_a_misspelled_or_invalid_queue_object_is_an_error(kind, path, change, error):
    obj = next(obj for obj in queue_objects() if obj["kind"] == kind)
    target = obj
    for key in path:
        target = target[key]
    target.update(change)
    assert any(error in problem for problem in kueue.queue_object_errors(obj)), kueue.queue_object_errors(obj)
