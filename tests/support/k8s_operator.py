"""What the Kubeflow training operator v1.9 does with a PyTorchJob, for tests without a cluster.

Transcribed from kubeflow/trainer at tag v1.9.4 (the release scripts/kind-cluster.sh installs):
defaults from pkg/apis/kubeflow.org/v1/pytorch_defaults.go, admission rules from
pkg/webhooks/pytorch/pytorchjob_webhook.go, the variables each container gets from
pkg/controller.v1/pytorch/{envvar,master,elastic}.go, and the init container every Worker gets when a Master exists
from pkg/controller.v1/pytorch/initcontainer.go.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

import yaml

CONTAINER = "pytorch"
PORT_NAME = "pytorchjob-port"
DEFAULT_PORT = 23456
REPLICA_TYPES = ("Master", "Worker")  # pod names and RANK follow this order
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# The operator's flags --pytorch-init-container-image and --pytorch-init-container-max-tries, at their defaults.
INIT_CONTAINER_IMAGE, INIT_CONTAINER_MAX_TRIES = "alpine:3.10", 100
# Its built-in init container, used unless --pytorch-init-container-template-file (default
# /etc/config/initContainer.yaml) names a file that exists: no securityContext at all.
DEFAULT_INIT_CONTAINER_TEMPLATE = """
- name: init-pytorch
  image: {{.InitContainerImage}}
  imagePullPolicy: IfNotPresent
  resources:
    limits: {cpu: 100m, memory: 20Mi}
    requests: {cpu: 50m, memory: 10Mi}
  command: ['sh', '-c', 'for i in $(seq {{.MaxTries}}); do nslookup {{.MasterAddr}} && exit 0; sleep 2; done; exit 1']
"""

Obj = dict[str, Any]


@dataclass(frozen=True)
class PodPlan:
    """One pod the operator creates: its name (also its host name and its Service's) and template."""

    name: str
    replica_type: str
    index: int
    template: Obj
    operator_env: tuple[tuple[str, str], ...]
    namespace: str = "default"
    labels: tuple[tuple[str, str], ...] = ()  # the pod's, its template's and the operator's (the job's name)
    container_name: str = CONTAINER  # the training container (a TrainJob's is "node": tests/support/trainer_v2.py)
    subdomain: str | None = None  # the headless Service that also names the pod <name>.<subdomain> (JobSet's)

    @property
    def container(self) -> Obj:
        return next(c for c in self.template["spec"]["containers"] if c["name"] == self.container_name)


def with_defaults(job: Obj) -> Obj:
    """SetDefaults_PyTorchJob: replicas 1, restart policy OnFailure, the default port, elastic bounds."""
    job = copy.deepcopy(job)
    spec = job["spec"]
    spec.setdefault("runPolicy", {}).setdefault("cleanPodPolicy", "None")
    for replica in spec["pytorchReplicaSpecs"].values():
        replica.setdefault("replicas", 1)
        replica.setdefault("restartPolicy", "OnFailure")
        for container in replica["template"]["spec"]["containers"]:
            ports = container.setdefault("ports", [])
            if container["name"] == CONTAINER and not any(port.get("name") == PORT_NAME for port in ports):
                ports.append({"name": PORT_NAME, "containerPort": DEFAULT_PORT})
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        bound = elastic.get("minReplicas", elastic.get("maxReplicas"))
        if bound is None:
            bound = spec["pytorchReplicaSpecs"]["Worker"]["replicas"]
        elastic.setdefault("minReplicas", bound)
        elastic.setdefault("maxReplicas", bound)
    if elastic is None or "nProcPerNode" not in elastic:
        spec.setdefault("nprocPerNode", "auto")
    return job


def admission_errors(job: Obj) -> list[str]:
    """The validating webhook's refusals: each one means `kubectl apply` fails."""
    errors = []
    name, spec = job["metadata"]["name"], job["spec"]
    if not DNS1035.match(name) or len(name) > 63:
        errors.append(f"metadata.name {name!r} is not a DNS-1035 label")
    replicas = spec.get("pytorchReplicaSpecs") or {}
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in replicas:
            errors.append("pytorchReplicaSpecs.Worker must be configured if elastic policy is used")
        if "nProcPerNode" in elastic and "nprocPerNode" in spec:
            errors.append("elasticPolicy.nProcPerNode must not be used with spec.nprocPerNode")
    if not replicas:
        errors.append("pytorchReplicaSpecs is required")
    for rtype, replica in replicas.items():
        containers = replica["template"]["spec"].get("containers", [])
        if rtype not in REPLICA_TYPES:
            errors.append(f"pytorchReplicaSpecs.{rtype}: replica type must be Master or Worker")
        if not containers:
            errors.append(f"pytorchReplicaSpecs.{rtype}: containers must be specified")
        errors += [f"pytorchReplicaSpecs.{rtype}: container {c.get('name')!r} has no image"
                   for c in containers if not c.get("image")]
        if not any(c.get("name") == CONTAINER for c in containers):
            errors.append(f"pytorchReplicaSpecs.{rtype}: needs a container named {CONTAINER!r}")
        count = replica.get("replicas")
        if rtype == "Master" and count != 1:
            errors.append("pytorchReplicaSpecs.Master.replicas must be 1")
        elif count is not None and count < 1:
            errors.append(f"pytorchReplicaSpecs.{rtype}.replicas must be at least 1")
    return errors


def pod_plans(job: Obj, init_container_template: str = DEFAULT_INIT_CONTAINER_TEMPLATE) -> list[PodPlan]:
    """Every pod of an admitted, defaulted job, Master first, with the variables the operator appends and the init
    containers it adds (``init_container_template``: the operator's, or the file its flag names)."""
    job = with_defaults(job)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    namespace = job["metadata"].get("namespace", "default")
    return [
        PodPlan(_pod_name(job, rtype, index), rtype, index, pod_template(job, rtype, init_container_template),
                tuple(operator_env(job, rtype, index)), namespace, tuple(operator_labels(job, rtype, index)))
        for rtype in REPLICA_TYPES if rtype in replicas
        for index in range(replicas[rtype]["replicas"])
    ]


def pod_template(job: Obj, rtype: str, init_container_template: str) -> Obj:
    """setInitContainer: a Worker of a job with a Master gets the template's init containers appended after its own
    (a name already there makes the pod invalid, so a job cannot replace them: only the operator's flag can)."""
    template = job["spec"]["pytorchReplicaSpecs"][rtype]["template"]
    if rtype != "Worker" or "Master" not in job["spec"]["pytorchReplicaSpecs"]:
        return template
    template = copy.deepcopy(template)
    values = {"MasterAddr": _pod_name(job, "Master", 0), "InitContainerImage": INIT_CONTAINER_IMAGE,
              "MaxTries": str(INIT_CONTAINER_MAX_TRIES)}
    text = re.sub(r"\{\{\s*\.(\w+)\s*\}\}", lambda field: values[field[1]], init_container_template)
    if "{{" in text:
        raise AssertionError(f"the init container template uses more than {sorted(values)}: {text}")
    template["spec"].setdefault("initContainers", []).extend(yaml.safe_load(text))
    return template


def operator_labels(job: Obj, rtype: str, index: int) -> list[tuple[str, str]]:
    """The template's labels and those the operator adds to each pod (GenLabels and the replica's own)."""
    labels = dict(job["spec"]["pytorchReplicaSpecs"][rtype]["template"].get("metadata", {}).get("labels", {}))
    labels.update({"training.kubeflow.org/job-name": job["metadata"]["name"],
                   "training.kubeflow.org/operator-name": "pytorchjob-controller",
                   "training.kubeflow.org/replica-type": rtype.lower(),
                   "training.kubeflow.org/replica-index": str(index)})
    return list(labels.items())


def operator_env(job: Obj, rtype: str, index: int) -> list[tuple[str, str]]:
    """setPodEnv for one container of a defaulted job, in the operator's order."""
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    total = sum(r["replicas"] for r in replicas.values())
    nproc = spec.get("nprocPerNode")
    # getNprocPerNodeInt: "auto" (or anything not an integer) counts as 1.
    world_size = total * (int(nproc) if nproc is not None and nproc.isdigit() else 1)
    env = [("PYTHONUNBUFFERED", "1")]
    if "Master" in replicas:
        port, master = str(_port(job, "Master")), _pod_name(job, "Master", 0)
        rank = str(index + 1 if rtype == "Worker" else index)
        env += [("MASTER_PORT", port), ("PET_MASTER_PORT", port), ("MASTER_ADDR", master),
                ("PET_MASTER_ADDR", master), ("WORLD_SIZE", str(world_size)), ("RANK", rank),
                ("PET_NODE_RANK", rank)]
    if nproc is not None:
        env.append(("PET_NPROC_PER_NODE", nproc))
    elastic = spec.get("elasticPolicy")
    if elastic is None:
        return [*env, ("PET_NNODES", str(total))]
    host = elastic.get("rdzvHost", _pod_name(job, "Worker", 0))
    env += [("PET_RDZV_ENDPOINT", f"{host}:{elastic.get('rdzvPort', _port(job, 'Worker'))}"),
            ("PET_RDZV_BACKEND", elastic.get("rdzvBackend", "c10d")),
            ("PET_NNODES", f"{elastic['minReplicas']}:{elastic['maxReplicas']}")]
    optional = (("maxRestarts", "PET_MAX_RESTARTS"), ("nProcPerNode", "PET_NPROC_PER_NODE"),
                ("rdzvId", "PET_RDZV_ID"))
    env += [(name, str(elastic[key])) for key, name in optional if key in elastic]
    if "rdzvConf" in elastic:
        env.append(("PET_RDZV_CONF", ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])))
    if elastic.get("standalone"):
        env.append(("PET_STANDALONE", ""))
    return env


def _pod_name(job: Obj, rtype: str, index: int) -> str:
    return f"{job['metadata']['name']}-{rtype.lower()}-{index}"


def _port(job: Obj, rtype: str) -> int:
    containers = job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]["containers"]
    for container in containers:
        if container["name"] == CONTAINER:
            for port in container.get("ports", []):
                if port.get("name") == PORT_NAME:
                    return port["containerPort"]
    raise AssertionError(f"{rtype}: no container port named {PORT_NAME!r} on the {CONTAINER!r} container")


def retries(restart_policy: str, exit_code: int) -> bool:
    """Whether a replica's pod that exited with ``exit_code`` is run again (pkg/controller.v1/common/pod.go,
    ReconcilePods, and IsRetryableExitCode in pkg/util/train/train_util.go): under ExitCode the operator recreates it
    for codes from 128 on and fails the job for the others; OnFailure and Always restart it whatever the code (the
    kubelet, in place); Never does not."""
    if exit_code == 0:
        return False
    if restart_policy == "ExitCode":
        return exit_code >= 128
    return restart_policy in ("OnFailure", "Always")
