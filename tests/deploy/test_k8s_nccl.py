"""NCCL's transport as a parameter: each component (k8s/components/nccl-*), listed in a GPU overlay (the
PyTorchJob's two and the TrainJob's) after the gpu component as docs/kubernetes.md says, gives every pod the
operator makes that transport's NCCL and libfabric settings and its device plugin's resource, requested and limited
alike; the job still passes the schemas and its operator's admission, and its pods the restricted Pod Security
profile.

What only a cluster shows, that NCCL then picks the transport ("Using network IB" in its INFO log), is not tested.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import kubernetes_validate
import pytest

from tests.support.job_pods import the_job
from tests.support.k8s_manifests import K8S_DIR, Obj, render, with_gpu_component
from tests.support.k8s_operator import PodPlan, admission_errors, pod_plans
from tests.support.kubeflow_api import api_errors
from tests.support.pod_security import strictest_profile
from tests.support.trainer_v2 import admission_errors as trainjob_admission_errors
from tests.support.trainer_v2 import pod_plans as trainer_v2_pods

GPU_OVERLAYS = ("k8s/overlays/gpu-single-node", "k8s/overlays/gpu-multi-node", "k8s/overlays/trainjob-gpu")
KUBERNETES_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
# Each component's settings and device, from the sources cited in its file.
ENV = {
    "nccl-tcp": {"NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "WARN"},
    "nccl-efa": {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_SOCKET_IFNAME": "eth0",
                 "NCCL_DEBUG": "WARN"},
    "nccl-infiniband": {"NCCL_NET": "IB", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "WARN"},
}
DEVICES = {"nccl-tcp": {}, "nccl-efa": {"vpc.amazonaws.com/efa": 16},
           "nccl-infiniband": {"rdma/rdma_shared_device_a": 1}}
# No component adds a capability (IPC_LOCK would be refused by baseline too, and is not effective for uid 1000).
PROFILE = {"nccl-tcp": "restricted", "nccl-efa": "restricted", "nccl-infiniband": "restricted"}
# The init container template k8s/operator installs (k8s/components/restricted-init-container), as the operator
# reads it from the generated ConfigMap.
INIT_CONTAINER_TEMPLATE = (K8S_DIR / "components" / "restricted-init-container" / "initContainer.yaml").read_text()
NCCL_NAMES = ("NCCL_", "FI_")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Obj]:
    """The overlay's job with the component listed after gpu, rendered once per pair."""
    @functools.cache
    def job(overlay: str, component: str) -> Obj:
        root: Path = tmp_path_factory.mktemp(component)
        return the_job(with_gpu_component(overlay, component, root))
    return job


def plans(job: Obj) -> list[PodPlan]:
    """Each pod its operator makes: the training operator's (with k8s/operator's init container) or Trainer v2's."""
    made = pod_plans(job, INIT_CONTAINER_TEMPLATE) if job["kind"] == "PyTorchJob" else trainer_v2_pods(job)
    assert made, "no pods"
    return made


def containers(job: Obj) -> list[Obj]:
    """The trainer container of each pod."""
    return [plan.container for plan in plans(job)]


def test_every_nccl_component_is_checked():
    assert {path.name for path in (K8S_DIR / "components").glob("nccl-*")} == set(ENV) == set(DEVICES) == set(PROFILE)


@pytest.mark.parametrize("component", sorted(ENV))
@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_every_gpu_pod_gets_the_components_nccl_settings(overlay, component, rendered):
    job = rendered(overlay, component)
    assert len(containers(job)) == (1 if overlay.endswith("single-node") else 2)
    for container in containers(job):
        names = [entry["name"] for entry in container["env"]]
        assert len(names) == len(set(names)), f"a variable set twice: {names}"
        added = {entry["name"]: entry["value"] for entry in container["env"] if entry["name"].startswith(NCCL_NAMES)}
        assert added == ENV[component]
        assert "HOME" in names and "DDP_JOB_ID" in names, "the base's variables are kept"


@pytest.mark.parametrize("component", sorted(DEVICES))
@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_every_gpu_pod_requests_and_limits_the_components_device_alike(overlay, component, rendered):
    for container in containers(rendered(overlay, component)):
        # Kubernetes refuses an extended resource whose request differs from its limit.
        for bound in ("requests", "limits"):
            extended = {name: value for name, value in container["resources"][bound].items()
                        if name not in ("cpu", "memory")}
            assert extended == {"nvidia.com/gpu": 4, **DEVICES[component]}, bound


@pytest.mark.parametrize("component", sorted(ENV))
@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_the_job_passes_its_schema_its_operators_admission_and_the_pod_schema(overlay, component, rendered):
    job = rendered(overlay, component)
    assert api_errors(job) == []
    assert (admission_errors if job["kind"] == "PyTorchJob" else trainjob_admission_errors)(job) == []
    # The CRD schemas stop at the pod's outline; Kubernetes' own schema checks every field of the pods made.
    for plan in plans(job):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": plan.name},
                        "template": plan.template}
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(pod_template, version, strict=True)


@pytest.mark.parametrize("component", sorted(PROFILE))
@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_the_pods_are_admitted_by_the_strictest_profile_they_need(overlay, component, rendered):
    for plan in plans(rendered(overlay, component)):
        assert strictest_profile(plan.template["spec"]) == PROFILE[component], plan.name


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_without_a_component_the_gpu_pods_leave_nccl_its_own_choice(overlay):
    for container in containers(the_job(render(overlay))):
        assert not [entry for entry in container["env"] if entry["name"].startswith(NCCL_NAMES)]
        assert set(container["resources"]["limits"]) == {"cpu", "memory", "nvidia.com/gpu"}
