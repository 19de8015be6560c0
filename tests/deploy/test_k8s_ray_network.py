"""k8s/ray's NetworkPolicy: Ray's dashboard and job API (8265), GCS (6379), client server (10001) and every other port
of the RayJob's pods reachable from that RayJob's own pods only, plus the KubeRay operator on the dashboard's port;
checked on the pods as KubeRay labels them (tests/support/kuberay_pods.py) under the policy rules of the API
(tests/support/network_policy.py). And Ray's token authentication, on, with a Ray that has it."""

from __future__ import annotations

import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.support.k8s_manifests import REPO_ROOT, Obj, of_kind, render
from tests.support.k8s_operator import pod_plans
from tests.support.kuberay_pods import rayjob_pods
from tests.support.network_policy import Pod, admitted

RAYJOB_SOURCES = ("k8s/ray", "k8s/overlays/rayjob-streamed-data")
DASHBOARD, GCS, CLIENT = 8265, 6379, 10001
# A raylet's, an object manager's or a Ray worker's port: Ray picks them at random.
RANDOM_PORT = 41234
RAY_PORTS = (DASHBOARD, GCS, CLIENT, RANDOM_PORT)
# Ray's token authentication (RAY_AUTH_MODE=token) first shipped in Ray 2.52.0 (Ray's docs, ray-security/token-auth).
TOKEN_AUTH_SINCE = Version("2.52.0")
# The KubeRay operator's pod as its Helm chart (v1.3 to v1.7) labels it, in a namespace of its own.
OPERATOR = Pod({"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/instance": "kuberay-operator",
                "app.kubernetes.io/component": "kuberay-operator"}, namespace="kuberay-system",
               namespace_labels={"kubernetes.io/metadata.name": "kuberay-system"})


def job_pods(source: str) -> tuple[list[Obj], dict[str, Pod]]:
    objects = render(source)
    (rayjob,) = of_kind(objects, "RayJob")
    return of_kind(objects, "NetworkPolicy"), {name: Pod(template["metadata"]["labels"])
                                                for name, template in rayjob_pods(rayjob).items()}


@pytest.mark.parametrize("source", RAYJOB_SOURCES)
def test_every_pod_of_the_rayjob_reaches_every_port_of_the_head_and_the_workers(source):
    policies, pods = job_pods(source)
    assert [policy["metadata"]["name"] for policy in policies] == ["ddp-train-ray"], "the base's is replaced"
    ray_nodes = [name for name in pods if name != "submitter"]
    assert "head" in ray_nodes and any(name.startswith("worker:") for name in ray_nodes)
    for target in ray_nodes:
        for source_pod in pods:
            for port in RAY_PORTS:
                assert admitted(policies, pods[source_pod], pods[target], port), (source_pod, target, port)


def other_pods(pods: dict[str, Pod]) -> dict[str, Pod]:
    """Pods of the namespace and the cluster that are not this RayJob's."""
    head = pods["head"].labels
    another_rayjob = {**head, "ray.io/originated-from-cr-name": "someone-else",
                      "ray.io/cluster": "someone-else-a1b2c"}
    a_raycluster = {key: value for key, value in head.items() if not key.startswith("ray.io/originated-from")}
    (pytorchjob,) = of_kind(render("k8s/base"), "PyTorchJob")
    master = pod_plans(pytorchjob)[0]
    return {
        "another RayJob's head": Pod(another_rayjob),
        "a RayCluster's head (no RayJob)": Pod(a_raycluster),
        "a PyTorchJob's pod": Pod(dict(master.labels)),
        "a pod without labels": Pod({}),
        "this job's labels in another namespace": Pod(head, namespace="elsewhere"),
    }


@pytest.mark.parametrize("source", RAYJOB_SOURCES)
def test_no_other_pod_reaches_a_port_of_the_rayjobs_pods(source):
    policies, pods = job_pods(source)
    for name, stranger in other_pods(pods).items():
        for target in pods:
            for port in RAY_PORTS:
                assert not admitted(policies, stranger, pods[target], port), (name, target, port)


@pytest.mark.parametrize("source", RAYJOB_SOURCES)
def test_the_kuberay_operator_reaches_the_heads_dashboard_and_nothing_else(source):
    policies, pods = job_pods(source)
    assert admitted(policies, OPERATOR, pods["head"], DASHBOARD), "KubeRay reads the job's status there"
    for target in pods:
        for port in (GCS, CLIENT, RANDOM_PORT):
            assert not admitted(policies, OPERATOR, pods[target], port), (target, port)


@pytest.mark.parametrize("source", RAYJOB_SOURCES)
def test_ray_token_authentication_is_on_and_every_ray_the_image_may_hold_has_it(source):
    (rayjob,) = of_kind(render(source), "RayJob")
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert cluster["authOptions"]["mode"] == "token"
    # The image's Ray is the ray extra's; its lowest version must know RAY_AUTH_MODE=token (Ray 2.52 and newer).
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = [Requirement(item) for item in extras["ray"] if Requirement(item).name == "ray"]
    lowest = [Version(clause.version) for clause in requirement.specifier if clause.operator in (">=", "==", "~=")]
    assert lowest and min(lowest) >= TOKEN_AUTH_SINCE, requirement
    assert Version(cluster["rayVersion"]) in requirement.specifier, "KubeRay's rayVersion is the image's Ray"
