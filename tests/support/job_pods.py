"""The pod templates each operator makes of a job, whatever its kind: the training operator's for a PyTorchJob,
Trainer v2's (JobSet's) for a TrainJob, KubeRay's for a RayJob."""

from __future__ import annotations

from tests.support.k8s_manifests import Obj
from tests.support.k8s_operator import pod_plans
from tests.support.kuberay_pods import rayjob_pods
from tests.support.trainer_v2 import pod_plans as trainer_v2_pods

JOB_KINDS = ("PyTorchJob", "TrainJob", "RayJob")


def the_job(objects: list[Obj]) -> Obj:
    (job,) = [obj for obj in objects if obj["kind"] in JOB_KINDS]
    return job


def pod_templates(job: Obj) -> list[Obj]:
    if job["kind"] == "PyTorchJob":
        return [plan.template for plan in pod_plans(job)]
    if job["kind"] == "TrainJob":
        return [plan.template for plan in trainer_v2_pods(job)]
    return list(rayjob_pods(job).values())


def pod_labels(job: Obj) -> list[dict[str, str]]:
    """The labels of each pod the job's operator creates: the template's and those the operator adds."""
    if job["kind"] == "PyTorchJob":
        return [dict(plan.labels) for plan in pod_plans(job)]
    if job["kind"] == "TrainJob":
        return [dict(plan.labels) for plan in trainer_v2_pods(job)]
    return [template["metadata"].get("labels", {}) for template in rayjob_pods(job).values()]
