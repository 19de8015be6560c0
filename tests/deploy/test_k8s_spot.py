"""Preemption that fits the grace period (docs/kubernetes.md): every pod of every job gives the trainer's own bound
(--grace-period-s) a margin before the kubelet's SIGKILL; the spot-node components (k8s/components/spot-nodes*),
rendered over the CPU job, the TrainJob and the GPU overlays, give every pod the spot grace period, a trainer bound
that fits it, a checkpoint interval that bounds what a save that does not fit loses, and their cloud's selector."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.support.k8s_manifests import K8S_DIR, KUSTOMIZATIONS, Obj, config_maps, of_kind, render
from tests.support.k8s_operator import PodPlan, pod_plans
from tests.support.trainer_v2 import pod_plans as trainer_v2_pods
from trainer.cli import parse_config
from trainer.config import CheckpointConfig

# The pod's grace period must exceed the trainer's by the forced exit's own lease release (bounded at 2 s,
# trainer.preemption.FORCED_EXIT_CLEANUP_S) and the process's end: figure 17 measured it well under a second.
MARGIN_S = 5
SPOT_POD_GRACE_S = 15  # GKE's default for non-system pods on a Spot VM, the tightest of the three clouds
SPOT_TRAINER_GRACE_S = 10
SPOT_CHECKPOINT_EVERY_S = 300
SPOT_SELECTORS = {"spot-nodes": None, "spot-nodes-gke": {"cloud.google.com/gke-spot": "true"},
                  "spot-nodes-eks": {"eks.amazonaws.com/capacityType": "SPOT"},
                  "spot-nodes-aks": {"kubernetes.azure.com/scalesetpriority": "spot"}}
AKS_SPOT_TOLERATION = {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value": "spot",
                       "effect": "NoSchedule"}
SPOT_TOLERATIONS = {"spot-nodes-aks": [AKS_SPOT_TOLERATION]}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
AKS_GPU_TOLERATION = {"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}  # gpu-nodes-aks
GPU_OVERLAYS = ("k8s/overlays/gpu-single-node", "k8s/overlays/gpu-multi-node", "k8s/overlays/trainjob-gpu")
JOBS = ("k8s/base", "k8s/trainer-v2")  # the CPU PyTorchJob and the TrainJob


def plans(objects: list[Obj]) -> list[PodPlan]:
    """Every pod the job's operator makes: the training operator's for a PyTorchJob, Trainer v2's for a TrainJob."""
    trainjobs = of_kind(objects, "TrainJob")
    if trainjobs:
        (trainjob,) = trainjobs
        return trainer_v2_pods(trainjob)
    (job,) = of_kind(objects, "PyTorchJob")
    return pod_plans(job)


def checkpoint_config(objects: list[Obj], plan: PodPlan, tmp_path: Path) -> CheckpointConfig:
    """The trainer's checkpoint settings as the pod's command reads them: the mounted ConfigMap's config.yaml, then
    the flags after --config, which override it."""
    words = [*plan.container.get("command", []), *plan.container.get("args", [])]
    at = words.index("--config")
    mount_path = Path(words[at + 1])
    volumes = {volume["name"]: volume for volume in plan.template["spec"]["volumes"]}
    (mount,) = [mount for mount in plan.container["volumeMounts"] if mount_path.is_relative_to(mount["mountPath"])]
    text = config_maps(objects)[volumes[mount["name"]]["configMap"]["name"]][
        str(mount_path.relative_to(mount["mountPath"]))]
    config_file = tmp_path / f"{plan.name}-config.yaml"
    config_file.write_text(text)
    config, _ = parse_config(["--config", str(config_file), *words[at + 2:]])
    return config.checkpoint


def with_components(tmp_path: Path, source: str, components: list[str], after: str | None = None) -> list[Obj]:
    """``source`` rendered in a copy of k8s/ with ``components`` listed: in the source's own kustomization after
    ``after``, or, without one, in an overlay of its own over the source."""
    shutil.copytree(K8S_DIR, tmp_path / "k8s", symlinks=True)
    names = [f"../../components/{component}" for component in components]
    if after is None:
        overlay = "k8s/overlays/spot-test"
        (tmp_path / overlay).mkdir()
        (tmp_path / overlay / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [f"../../{source.removeprefix('k8s/')}"], "components": names}))
        return render(overlay, tmp_path)
    path = tmp_path / source / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    listed = kustomization["components"]
    at = listed.index(f"../../components/{after}") + 1
    kustomization["components"] = [*listed[:at], *names, *listed[at:]]
    path.write_text(yaml.safe_dump(kustomization))
    return render(source, tmp_path)


def assert_spot_timing(objects: list[Obj], expected_pods: int, tmp_path: Path) -> list[PodPlan]:
    found = plans(objects)
    assert len(found) == expected_pods
    for plan in found:
        pod_grace_s = plan.template["spec"]["terminationGracePeriodSeconds"]
        checkpoint = checkpoint_config(objects, plan, tmp_path)
        assert pod_grace_s == SPOT_POD_GRACE_S, plan.name
        assert checkpoint.grace_period_s == SPOT_TRAINER_GRACE_S, plan.name
        assert checkpoint.grace_period_s + MARGIN_S <= pod_grace_s, plan.name
        assert checkpoint.checkpoint_every_s == SPOT_CHECKPOINT_EVERY_S, plan.name
    return found


@pytest.mark.parametrize("source", KUSTOMIZATIONS)
def test_every_pod_outlives_the_trainers_own_bound_by_the_margin(source, tmp_path):
    objects = render(source)
    found = plans(objects)
    assert found, source
    for plan in found:
        grace_s = checkpoint_config(objects, plan, tmp_path).grace_period_s
        assert grace_s + MARGIN_S <= plan.template["spec"]["terminationGracePeriodSeconds"], plan.name


@pytest.mark.parametrize("component", sorted(SPOT_SELECTORS))
@pytest.mark.parametrize("source", JOBS)
def test_spot_components_give_every_pod_the_spot_timing_and_their_clouds_placement(source, component, tmp_path):
    for plan in assert_spot_timing(with_components(tmp_path, source, [component]), 2, tmp_path):
        spec = plan.template["spec"]
        assert (spec.get("nodeSelector") or None) == SPOT_SELECTORS[component], plan.name  # {}: none
        assert spec.get("tolerations", []) == SPOT_TOLERATIONS.get(component, []), plan.name


@pytest.mark.parametrize("cloud", ["gke", "eks"])
@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_on_a_gpu_overlay_the_spot_selector_joins_the_gpu_nodes_one(overlay, cloud, tmp_path):
    gpu_only = plans(with_components(tmp_path / "gpu", overlay, [f"gpu-nodes-{cloud}"], after="gpu"))[0]
    gpu_selector = gpu_only.template["spec"]["nodeSelector"]
    objects = with_components(tmp_path / "spot", overlay, [f"gpu-nodes-{cloud}", f"spot-nodes-{cloud}"], after="gpu")
    pods = 1 if overlay.endswith("single-node") else 2
    for plan in assert_spot_timing(objects, pods, tmp_path):
        spec = plan.template["spec"]
        assert spec["nodeSelector"] == {**gpu_selector, **SPOT_SELECTORS[f"spot-nodes-{cloud}"]}, plan.name
        assert spec["tolerations"] == [GPU_TOLERATION], plan.name


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_on_a_gpu_overlay_the_aks_spot_toleration_joins_the_gpu_ones(overlay, tmp_path):
    objects = with_components(tmp_path, overlay, ["gpu-nodes-aks", "spot-nodes-aks"], after="gpu")
    for plan in assert_spot_timing(objects, 1 if overlay.endswith("single-node") else 2, tmp_path):
        spec = plan.template["spec"]
        assert spec["tolerations"] == [GPU_TOLERATION, AKS_GPU_TOLERATION, AKS_SPOT_TOLERATION], plan.name
        assert spec["nodeSelector"] == SPOT_SELECTORS["spot-nodes-aks"], plan.name
