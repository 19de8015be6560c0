"""The pods KubeRay makes of a RayJob (K8sJobMode), for tests without a cluster: what it adds to the templates.

Transcribed from ray-project/kuberay at v1.3.0 and v1.7.0 (k8s/ray needs v1.5.1 or newer, for authOptions), which
agree on these (the variables KubeRay adds, RAY_AUTH_MODE and RAY_AUTH_TOKEN among them, are not emulated):
ray-operator/controllers/ray/common/pod.go gives every worker pod an init container `wait-gcs-ready` (unless the
operator runs with ENABLE_INIT_CONTAINER_INJECTION=false) whose image and securityContext are copied from the pod's
first container; common/job.go and rayjob_controller.go (getSubmitterTemplate) use the RayJob's
submitterPodTemplate as it is when given (its first container the submitter, command and variables filled in),
else a default pod of one container `ray-job-submitter`, the head's image, resources and nothing else.

Labels, for network policies: common/pod.go's labelPod gives head and worker pods ray.io/is-ray-node, ray.io/cluster
(the RayCluster's name: the RayJob's and a random suffix, utils.GenerateRayClusterName), ray.io/node-type,
ray.io/group, ray.io/identifier, app.kubernetes.io/name and .../created-by, the template's labels overriding all
but ray.io/node-type, ray.io/group and ray.io/cluster. The submitter pod has its template's labels and those the
Job controller adds (batch.kubernetes.io/job-name, job-name: the Job is named as the RayJob); v1.3 adds no more,
v1.7 sets ray.io/originated-from-crd and ray.io/originated-from-cr-name too (rayjob_controller.go,
getSubmitterTemplate): emulated as v1.3, which leaves those two to the template.
"""

from __future__ import annotations

import copy
from typing import Any

Obj = dict[str, Any]


def rayjob_pods(rayjob: Obj) -> dict[str, Obj]:
    """The pod template of each kind of pod KubeRay creates for the RayJob: "head", "worker:<group>", "submitter"."""
    spec = rayjob["spec"]
    cluster = spec["rayClusterSpec"]
    if cluster.get("enableInTreeAutoscaling"):
        raise AssertionError("the autoscaler's sidecar on the head is not emulated")
    ray_cluster = f"{rayjob['metadata']['name']}-{CLUSTER_SUFFIX}"
    pods = {"head": _labelled(cluster["headGroupSpec"]["template"], ray_cluster, "head", "headgroup")}
    for group in cluster.get("workerGroupSpecs", []):
        worker = _labelled(group["template"], ray_cluster, "worker", group["groupName"])
        pods[f"worker:{group['groupName']}"] = _with_wait_gcs_ready(worker)
    submitter = copy.deepcopy(spec.get("submitterPodTemplate") or _default_submitter(cluster))
    submitter.setdefault("metadata", {}).setdefault("labels", {}).update(
        {"batch.kubernetes.io/job-name": rayjob["metadata"]["name"], "job-name": rayjob["metadata"]["name"]})
    pods["submitter"] = submitter
    return pods


# GenerateRayClusterName's random part: five lower-case letters and digits, another for every RayCluster.
CLUSTER_SUFFIX = "x7k2q"


def _labelled(template: Obj, ray_cluster: str, node_type: str, group: str) -> Obj:
    template = copy.deepcopy(template)
    labels = {"ray.io/is-ray-node": "yes", "ray.io/identifier": f"{ray_cluster}-{node_type}",
              "app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": "kuberay-operator"}
    labels.update(template.get("metadata", {}).get("labels", {}))
    labels.update({"ray.io/cluster": ray_cluster, "ray.io/node-type": node_type, "ray.io/group": group})
    template.setdefault("metadata", {})["labels"] = labels
    return template


def _with_wait_gcs_ready(template: Obj) -> Obj:
    template = copy.deepcopy(template)
    ray = template["spec"]["containers"][0]
    wait = {"name": "wait-gcs-ready", "image": ray["image"], "command": ["/bin/bash", "-lc", "--"],
            "args": ["until ray health-check; do sleep 5; done"]}
    if "securityContext" in ray:
        wait["securityContext"] = copy.deepcopy(ray["securityContext"])
    template["spec"].setdefault("initContainers", []).append(wait)
    return template


def _default_submitter(cluster: Obj) -> Obj:
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    return {"spec": {"restartPolicy": "Never", "containers": [{
        "name": "ray-job-submitter", "image": head["image"],
        "resources": {"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "500m", "memory": "200Mi"}}}]}}
