"""The GPU TrainJob (k8s/overlays/trainjob-gpu) is the GPU PyTorchJob (k8s/overlays/gpu-multi-node) under Trainer v2:
each node's pod, as Trainer v2 and JobSet build it (tests/support/trainer_v2.py), gets what each PyTorchJob replica
gets from k8s/components/gpu, so that the two cannot drift apart. Neither runs on a GPU here: the executed jobs
(tests/deploy/test_k8s_jobs.py) are CPU jobs."""

from __future__ import annotations

import pytest

from tests.support.k8s_manifests import TRAINJOB_SOURCES, Obj, config_maps, of_kind, render
from tests.support.k8s_operator import PodPlan
from tests.support.k8s_operator import pod_plans as pytorchjob_pods
from tests.support.trainer_v2 import pod_plans as trainer_v2_pods

GPU_TRAINJOB, GPU_PYTORCHJOB = "k8s/overlays/trainjob-gpu", "k8s/overlays/gpu-multi-node"


def trainjob_nodes(source: str) -> list[PodPlan]:
    (trainjob,) = of_kind(render(source), "TrainJob")
    return trainer_v2_pods(trainjob)


def gpu_settings(plan: PodPlan) -> Obj:
    """What the gpu component sets on a pod: image, resources, /dev/shm, where it runs, its processes, its command."""
    spec = plan.template["spec"]
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    (shm,) = [mount for mount in plan.container["volumeMounts"] if mount["mountPath"] == "/dev/shm"]
    return {"image": plan.container["image"], "resources": plan.container["resources"],
            "shm": volumes[shm["name"]]["emptyDir"], "tolerations": spec.get("tolerations"),
            "nodeSelector": spec.get("nodeSelector") or None,  # the TrainJob's empty map is none
            "processes": dict(plan.operator_env)["PET_NPROC_PER_NODE"],
            "command": [*plan.container.get("command", []), *plan.container.get("args", [])]}


def test_each_gpu_trainjob_node_gets_what_each_gpu_pytorchjob_replica_gets():
    (job,) = of_kind(render(GPU_PYTORCHJOB), "PyTorchJob")
    replicas = [gpu_settings(plan) for plan in pytorchjob_pods(job)]
    nodes = [gpu_settings(plan) for plan in trainjob_nodes(GPU_TRAINJOB)]
    assert len(nodes) == len(replicas) == 2
    assert nodes == replicas
    assert replicas[0]["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_the_gpu_trainjob_trains_with_the_gpu_pytorchjob_s_config():
    """The same ConfigMap (device cuda, backend nccl), from the same component."""
    trainjob, pytorchjob = config_maps(render(GPU_TRAINJOB)), config_maps(render(GPU_PYTORCHJOB))
    assert trainjob["ddp-train-config"] == pytorchjob["ddp-train-config"]
    assert "device: cuda" in trainjob["ddp-train-config"]["config.yaml"]


@pytest.mark.parametrize("source", TRAINJOB_SOURCES)
def test_each_trainjob_node_runs_one_process_per_gpu_or_one_on_cpus(source):
    """Trainer v2 hands numProcPerNode to torchrun as PET_NPROC_PER_NODE; without it, "auto", torchrun starts one
    process per requested CPU on a CPU node (torch.go), where the trainer wants one."""
    for plan in trainjob_nodes(source):
        resources = plan.container["resources"]
        gpus = resources["limits"].get("nvidia.com/gpu")
        assert resources["requests"].get("nvidia.com/gpu") == gpus, f"{plan.name}: GPUs are requested as limited"
        assert dict(plan.operator_env)["PET_NPROC_PER_NODE"] == str(gpus or 1), plan.name
