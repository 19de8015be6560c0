"""What Kubeflow Trainer v2 and JobSet do with a TrainJob under the ``torch-distributed`` runtime, for tests
without a cluster: the pods they create and what each one's ``node`` container is given.

Transcribed from kubeflow/trainer v2.3.0 (pkg/runtime/framework/plugins/torch/torch.go, .../jobset/jobset.go,
pkg/constants): the webhook refuses a TrainJob whose trainer sets any of torchrun's reserved variables, and runtime
patches whose manager is not a domain-prefixed path or that name a job or container the runtime does not have (the
torch-distributed runtime: the job ``node`` and its one container ``node``) or give that container variables (those
are the trainer's); the plugin appends PET_NNODES
(numNodes), PET_NPROC_PER_NODE, PET_NODE_RANK (the Job's completion index), PET_MASTER_ADDR (node 0's name under
the JobSet's headless Service) and PET_MASTER_PORT (29500) after the trainer's own env. Each pod's host name is
``<jobset>-<replicated job>-<job index>-<pod index>`` (its name adds a random suffix, which nothing here reads; a
plan's ``name`` is the host name), its subdomain the JobSet (the TrainJob's name), and it is labelled with the
JobSet's name. The pod template is the runtime's ``node`` job as the TrainJob's runtimePatches shape it, its
container given the trainer's image, command, args and resources, and the trainer's env upserted over the env
the patches give it.
"""

from __future__ import annotations

import copy
import re

from tests.support.k8s_operator import Obj, PodPlan

NODE = "node"  # the runtime's replicated job and the trainer's container
TRAINER_PORT = 29500  # constants.ContainerTrainerPort
RESERVED = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
# k8s.io/apimachinery's validation.IsDomainPrefixedPath: an RFC 1123 subdomain, "/", HTTP path characters.
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_HTTP_PATH = re.compile(r"[A-Za-z0-9/\-._~%!$&'()*+,;=:]+")


def admission_errors(trainjob: Obj) -> list[str]:
    """The refusals of the torch and JobSet plugins (Validate): each one means `kubectl apply` fails."""
    reserved = sorted({entry["name"] for entry in trainjob["spec"]["trainer"].get("env", [])} & set(RESERVED))
    errors = [f"spec.trainer.env: must not have reserved envs, invalid envs configured: {reserved}"] if reserved else []
    for patch in trainjob["spec"].get("runtimePatches", []):
        errors += _runtime_patch_errors(patch)
    return errors


def _runtime_patch_errors(patch: Obj) -> list[str]:
    errors = []
    host, _, path = patch.get("manager", "").partition("/")
    if not (len(host) <= 253 and _SUBDOMAIN.fullmatch(host) and _HTTP_PATH.fullmatch(path)):
        errors.append(f"spec.runtimePatches.manager: Invalid value: {patch.get('manager', '')!r}: must be a "
                      'domain-prefixed path (such as "acme.io/foo")')
    jobs = patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", [])
    for job in jobs:
        if job["name"] != NODE:
            errors.append("spec.runtimePatches: must not have replicated job that doesn't exist in the runtime job "
                          "template")
            continue
        pod = job.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
        for kind in ("initContainers", "containers"):
            for container in pod.get(kind, []):
                if container["name"] != NODE:
                    errors.append(f"spec.runtimePatches: must not have {kind.removesuffix('s')} that doesn't exist "
                                  f"in the runtime job {NODE}")
                elif container.get("env"):
                    errors.append("spec.runtimePatches: must not have envs for the dataset-initializer, "
                                  "model-initializer, node containers")
    return errors


def pod_plans(trainjob: Obj) -> list[PodPlan]:
    """Every pod of an admitted TrainJob, node 0 first, with the variables the torch plugin sets."""
    name, trainer = trainjob["metadata"]["name"], trainjob["spec"]["trainer"]
    namespace = trainjob["metadata"].get("namespace", "default")
    nodes, per_node = trainer.get("numNodes", 1), trainer.get("numProcPerNode")
    if not isinstance(per_node, int):
        raise AssertionError(f"numProcPerNode {per_node!r}: only a number of processes is emulated")
    template = _node_template(trainjob)
    labels = {**template.get("metadata", {}).get("labels", {}), "jobset.sigs.k8s.io/jobset-name": name}
    plans = []
    for index in range(nodes):
        plugin_env = (("PET_NNODES", str(nodes)), ("PET_NPROC_PER_NODE", str(per_node)),
                      ("PET_NODE_RANK", str(index)), ("PET_MASTER_ADDR", f"{name}-{NODE}-0-0.{name}"),
                      ("PET_MASTER_PORT", str(TRAINER_PORT)))
        plans.append(PodPlan(f"{name}-{NODE}-0-{index}", NODE, index, template, plugin_env, namespace,
                             tuple(labels.items()), container_name=NODE, subdomain=name))
    return plans


def _node_template(trainjob: Obj) -> Obj:
    """The runtime's node pod template with the TrainJob's runtimePatches applied, its container the trainer."""
    template: Obj = {"spec": {"containers": [{"name": NODE}]}}
    for patch in trainjob["spec"].get("runtimePatches", []):
        jobs = patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", [])
        for job in jobs:
            if job["name"] == NODE:
                template = _merged(template, job["template"]["spec"]["template"])
    trainer = trainjob["spec"]["trainer"]
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == NODE]
    container.update({key: copy.deepcopy(trainer[key]) for key in ("image", "command", "args") if key in trainer})
    # Upserted by name, as apply.UpsertEnvVars does: a patch's variable keeps its place, the trainer's value wins.
    env = {entry["name"]: entry for entry in container.get("env", [])}
    env.update({entry["name"]: copy.deepcopy(entry) for entry in trainer.get("env", [])})
    container["env"] = list(env.values())
    if "resourcesPerNode" in trainer:
        container["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
    return template


def _merged(base: Obj, patch: Obj) -> Obj:
    """A strategic merge as far as these templates need: maps merge, lists of named items merge by name."""
    merged = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        elif isinstance(value, list) and all(isinstance(item, dict) and "name" in item for item in value):
            by_name = {item["name"]: item for item in merged.get(key, [])}
            for item in value:
                by_name[item["name"]] = _merged(by_name.get(item["name"], {}), item)
            merged[key] = list(by_name.values())
        else:
            merged[key] = copy.deepcopy(value)
    return merged
