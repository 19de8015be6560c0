"""The pods KubeRay makes of a RayJob (K8sJobMode), for tests without a cluster: what it adds to the templates.

Transcribed from ray-project/kuberay at v1.3.0 and v1.7.0 (the range k8s/ray supports), which agree on these:
ray-operator/controllers/ray/common/pod.go gives every worker pod an init container `wait-gcs-ready` (unless the
operator runs with ENABLE_INIT_CONTAINER_INJECTION=false) whose image and securityContext are copied from the pod's
first container; common/job.go and rayjob_controller.go (getSubmitterTemplate) use the RayJob's
submitterPodTemplate as it is when given (its first container the submitter, command and variables filled in),
else a default pod of one container `ray-job-submitter`, the head's image, resources and nothing else.
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
    pods = {"head": copy.deepcopy(cluster["headGroupSpec"]["template"])}
    for group in cluster.get("workerGroupSpecs", []):
        pods[f"worker:{group['groupName']}"] = _with_wait_gcs_ready(group["template"])
    pods["submitter"] = copy.deepcopy(spec.get("submitterPodTemplate") or _default_submitter(cluster))
    return pods


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
