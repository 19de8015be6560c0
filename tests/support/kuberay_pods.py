"""The pods KubeRay makes of a RayJob (K8sJobMode), for tests without a cluster: what it adds to the templates.

Transcribed from ray-project/kuberay at each release k8s/ray names (KUBERAY_RELEASES: v1.5.1, the first with
authOptions, to v1.7.0; the variables KubeRay adds, RAY_AUTH_MODE and RAY_AUTH_TOKEN among them, are not emulated):
ray-operator/controllers/ray/common/pod.go gives every worker pod an init container `wait-gcs-ready` (unless the
operator runs with ENABLE_INIT_CONTAINER_INJECTION=false) whose image and securityContext are copied from the pod's
first container; common/job.go and rayjob_controller.go (getSubmitterTemplate) use the RayJob's
submitterPodTemplate as it is when given (its first container the submitter, command and variables filled in),
else a default pod of one container `ray-job-submitter`, the head's image, resources and nothing else.

Probes: pod.go's initLivenessAndReadinessProbe gives the Ray container (each pod's first) a liveness and a readiness
probe, each only where the template has none (`if rayContainer.LivenessProbe == nil`, in every release named; unless
the operator runs with ENABLE_PROBES_INJECTION=false). v1.5's exec `wget` (utils/constant.go's
BaseWgetHealthCommand) against the dashboard agent (52365) and, on the head, the dashboard (8265); v1.6.0 and newer,
for a rayVersion of 2.53 or newer (supportsUnifiedHealthCheck), an httpGet on the agent's /api/healthz instead.

Labels, for network policies: common/pod.go's labelPod gives head and worker pods ray.io/is-ray-node, ray.io/cluster
(the RayCluster's name: the RayJob's and a random suffix, utils.GenerateRayClusterName), ray.io/node-type,
ray.io/group, ray.io/identifier, app.kubernetes.io/name and .../created-by, the template's labels overriding all
but ray.io/node-type, ray.io/group and ray.io/cluster. The submitter pod has its template's labels and those the
Job controller adds (batch.kubernetes.io/job-name, job-name: the Job is named as the RayJob); v1.7 sets
ray.io/originated-from-crd and ray.io/originated-from-cr-name too (rayjob_controller.go, getSubmitterTemplate),
older ones leave those two to the template: the oldest release, the default here, is what a network policy must
work with.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

Obj = dict[str, Any]


@dataclass(frozen=True)
class KubeRay:
    """A KubeRay release, by what it does differently to a RayJob's pods."""

    tag: str
    # v1.6.0: the Ray container's probes are an httpGet on the dashboard agent's /api/healthz where the cluster's
    # rayVersion is at least 2.53 (pod.go, supportsUnifiedHealthCheck); before, and below that Ray, exec `wget`.
    http_probes: bool
    # v1.7.0: the K8sJobMode submitter first waits for the dashboard's GCS with `python -c` (common/job.go,
    # BuildJobSubmitCommand; v1.6 waits in SidecarMode only, v1.5 there alone and with wget).
    submitter_waits_for_gcs: bool
    # v1.7.0: getSubmitterTemplate labels the submitter with the RayJob's ray.io/originated-from-* pair.
    labels_submitter: bool


# v1.5.2 does to the pods what v1.5.1 does, v1.6.1 and v1.6.2 what v1.6.0 does (the same pod.go and job.go code).
KUBERAY_RELEASES = (KubeRay("v1.5.1", http_probes=False, submitter_waits_for_gcs=False, labels_submitter=False),
                    KubeRay("v1.6.0", http_probes=True, submitter_waits_for_gcs=False, labels_submitter=False),
                    KubeRay("v1.7.0", http_probes=True, submitter_waits_for_gcs=True, labels_submitter=True))
OLDEST = KUBERAY_RELEASES[0]

# utils/constant.go, the same in every release named.
DASHBOARD_AGENT_PORT, DASHBOARD_PORT = 52365, 8265
UNIFIED_HEALTH_SINCE_RAY = Version("2.53.0")
NODE_HEALTH_PATH = "/api/healthz"
PROBE_TIMINGS = {  # (the head's timeout, the workers' timeout), then the rest
    "readinessProbe": ((5, 2), {"initialDelaySeconds": 10, "periodSeconds": 5, "successThreshold": 1,
                                "failureThreshold": 10}),
    "livenessProbe": ((5, 2), {"initialDelaySeconds": 30, "periodSeconds": 5, "successThreshold": 1,
                               "failureThreshold": 120}),
}
WGET = "wget --tries 1 -T {timeout} -q -O- http://localhost:{port}/{path} | grep success"
PYTHON_HEALTH = ("python -c \"import urllib.request; r=urllib.request.urlopen('{url}', timeout={timeout}); "
                 "exit(0 if b'success' in r.read() else 1)\"")


def rayjob_pods(rayjob: Obj, kuberay: KubeRay = OLDEST) -> dict[str, Obj]:
    """The pod template of each kind of pod KubeRay creates for the RayJob: "head", "worker:<group>", "submitter"."""
    spec = rayjob["spec"]
    cluster = spec["rayClusterSpec"]
    if cluster.get("enableInTreeAutoscaling"):
        raise AssertionError("the autoscaler's sidecar on the head is not emulated")
    ray_cluster = f"{rayjob['metadata']['name']}-{CLUSTER_SUFFIX}"
    head_group = cluster["headGroupSpec"]
    pods = {"head": _with_probes(_labelled(head_group["template"], ray_cluster, "head", "headgroup"), "head",
                                 head_group.get("rayStartParams", {}), cluster, kuberay)}
    for group in cluster.get("workerGroupSpecs", []):
        worker = _labelled(group["template"], ray_cluster, "worker", group["groupName"])
        worker = _with_probes(worker, "worker", group.get("rayStartParams", {}), cluster, kuberay)
        pods[f"worker:{group['groupName']}"] = _with_wait_gcs_ready(worker)
    pods["submitter"] = _submitter(rayjob, ray_cluster, kuberay)
    return pods


# GenerateRayClusterName's random part: five lower-case letters and digits, another for every RayCluster.
CLUSTER_SUFFIX = "x7k2q"
# GenerateRayJobId's: the Ray job's submission id is the RayJob's name and five more.
JOB_ID_SUFFIX = "m4r8w"


def _labelled(template: Obj, ray_cluster: str, node_type: str, group: str) -> Obj:
    template = copy.deepcopy(template)
    labels = {"ray.io/is-ray-node": "yes", "ray.io/identifier": f"{ray_cluster}-{node_type}",
              "app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": "kuberay-operator"}
    labels.update(template.get("metadata", {}).get("labels", {}))
    labels.update({"ray.io/cluster": ray_cluster, "ray.io/node-type": node_type, "ray.io/group": group})
    template.setdefault("metadata", {})["labels"] = labels
    return template


def _with_probes(template: Obj, node_type: str, ray_start_params: Obj, cluster: Obj, kuberay: KubeRay) -> Obj:
    template = copy.deepcopy(template)
    ray = template["spec"]["containers"][0]
    # v1.6 and newer read the ports from rayStartParams (getPort); v1.5 uses the defaults whatever they say.
    agent_port, dashboard_port = DASHBOARD_AGENT_PORT, DASHBOARD_PORT
    if kuberay.http_probes:
        agent_port = int(ray_start_params.get("dashboard-agent-listen-port", agent_port))
        dashboard_port = int(ray_start_params.get("dashboard-port", dashboard_port))
    http = kuberay.http_probes and _version(cluster.get("rayVersion", "")) >= UNIFIED_HEALTH_SINCE_RAY
    # The timeouts of v1.5's wget are KubeRay's own constants: the readiness timeout, and its failure threshold.
    checks = [WGET.format(timeout=2, port=agent_port, path="api/local_raylet_healthz")]
    if node_type == "head":
        checks.append(WGET.format(timeout=10, port=dashboard_port, path="api/gcs_healthz"))
    for field, ((head_timeout, worker_timeout), timings) in PROBE_TIMINGS.items():
        if field in ray:
            continue
        action = ({"httpGet": {"path": NODE_HEALTH_PATH, "port": agent_port}} if http else
                  {"exec": {"command": ["bash", "-c", " && ".join(checks)]}})
        timeout = head_timeout if node_type == "head" else worker_timeout
        ray[field] = {**timings, "timeoutSeconds": timeout, **action}
    return template


def _version(text: str) -> Version:
    try:
        return Version(text)
    except ValueError:  # KubeRay's ParseGeneric failing: no unified health check
        return Version("0")


def _with_wait_gcs_ready(template: Obj) -> Obj:
    template = copy.deepcopy(template)
    ray = template["spec"]["containers"][0]
    wait = {"name": "wait-gcs-ready", "image": ray["image"], "command": ["/bin/bash", "-lc", "--"],
            "args": ["until ray health-check; do sleep 5; done"]}
    if "securityContext" in ray:
        wait["securityContext"] = copy.deepcopy(ray["securityContext"])
    template["spec"].setdefault("initContainers", []).append(wait)
    return template


def _submitter(rayjob: Obj, ray_cluster: str, kuberay: KubeRay) -> Obj:
    spec = rayjob["spec"]
    name = rayjob["metadata"]["name"]
    submitter = copy.deepcopy(spec.get("submitterPodTemplate") or _default_submitter(spec["rayClusterSpec"]))
    labels = submitter.setdefault("metadata", {}).setdefault("labels", {})
    labels.update({"batch.kubernetes.io/job-name": name, "job-name": name})
    if kuberay.labels_submitter:
        labels.update({"ray.io/originated-from-cr-name": name, "ray.io/originated-from-crd": "RayJob"})
    container = submitter["spec"]["containers"][0]
    # configureSubmitterContainer: KubeRay's command where the template's container has none (K8sJobMode).
    if not container.get("command"):
        container["command"] = ["/bin/bash", "-ce", "--"]
        container["args"] = [_submit_script(rayjob, ray_cluster, kuberay)]
    address = f"{ray_cluster}-head-svc.default.svc.cluster.local:{DASHBOARD_PORT}"
    container.setdefault("env", []).extend([
        {"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "RAY_DASHBOARD_ADDRESS", "value": address},
        {"name": "RAY_JOB_SUBMISSION_ID", "value": f"{name}-{JOB_ID_SUFFIX}"}])
    return submitter


def _submit_script(rayjob: Obj, ray_cluster: str, kuberay: KubeRay) -> str:
    """BuildJobSubmitCommand's shell script, K8sJobMode: submit once (a retried submitter finds the job and follows
    its logs instead), then follow the logs until the job ends."""
    address = f"http://{ray_cluster}-head-svc.default.svc.cluster.local:{DASHBOARD_PORT}"
    job_id = f"{rayjob['metadata']['name']}-{JOB_ID_SUFFIX}"
    words = []
    if kuberay.submitter_waits_for_gcs:
        health = PYTHON_HEALTH.format(url=f"{address}/api/gcs_healthz", timeout=10)
        words += ["until", health, ">/dev/null", "2>&1", ";", "do", "echo",
                  f'"Waiting for Ray Dashboard GCS to become healthy at {address} ..."', ";", "sleep", "2", ";",
                  "done", ";"]
    words += ["if", "!", "ray", "job", "status", "--address", address, job_id, ">/dev/null", "2>&1", ";", "then",
              "ray", "job", "submit", "--address", address, "--no-wait", "--submission-id", job_id, "--",
              rayjob["spec"]["entrypoint"].strip(), ";", "fi", ";", "ray", "job", "logs", "--address", address,
              "--follow", job_id]
    return " ".join(words)


def _default_submitter(cluster: Obj) -> Obj:
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    return {"spec": {"restartPolicy": "Never", "containers": [{
        "name": "ray-job-submitter", "image": head["image"],
        "resources": {"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "500m", "memory": "200Mi"}}}]}}
