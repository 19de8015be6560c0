"""GPU node selection as a parameter: each cloud's component (k8s/components/gpu-nodes-*), listed in a GPU overlay
after the gpu component as docs/kubernetes.md says, gives every pod the operator makes that cloud's toleration or
node selector, and nothing of another cloud's, and keeps the base's nvidia.com/gpu toleration."""

from __future__ import annotations

import pytest

from tests.support.job_pods import pod_templates, the_job
from tests.support.k8s_manifests import render, with_gpu_component

GPU_OVERLAYS = ("k8s/overlays/gpu-single-node", "k8s/overlays/gpu-multi-node", "k8s/overlays/trainjob-gpu")
BASE_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
# What each cloud's GPU nodes carry, from its provider's documentation (cited in each component): AKS's GPU pools
# are tainted sku=gpu:NoSchedule; GKE labels each GPU node with its accelerator type; on EKS the instance type is
# the one label every provisioner sets.
EXTRA_TOLERATIONS = {"gpu-nodes-aks": [{"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
                     "gpu-nodes-gke": [], "gpu-nodes-eks": []}
NODE_SELECTORS = {"gpu-nodes-aks": None, "gpu-nodes-gke": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
                  "gpu-nodes-eks": {"node.kubernetes.io/instance-type": "p5.48xlarge"}}


@pytest.mark.parametrize("component", sorted(NODE_SELECTORS))
@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_every_gpu_pod_gets_its_clouds_toleration_and_node_selector(overlay, component, tmp_path):
    templates = pod_templates(the_job(with_gpu_component(overlay, component, tmp_path)))
    assert len(templates) == (1 if overlay.endswith("single-node") else 2)
    for template in templates:
        spec = template["spec"]
        assert spec["tolerations"] == [BASE_TOLERATION, *EXTRA_TOLERATIONS[component]]
        assert (spec.get("nodeSelector") or None) == NODE_SELECTORS[component]  # {}: none


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_without_a_component_gpu_pods_tolerate_only_nvidia_gpu_and_select_no_node(overlay):
    for template in pod_templates(the_job(render(overlay))):
        assert template["spec"]["tolerations"] == [BASE_TOLERATION]
        assert not template["spec"].get("nodeSelector")
