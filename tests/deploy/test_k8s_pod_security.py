"""Every pod that applying a manifest leads to, as its operator creates it, against the restricted Pod Security
profile (tests/support/pod_security.py: the profile's rules, each named by its check in pod-security-admission).

The pods include what the operators add: training-operator v1.9's `init-pytorch` in every Worker of a job with a
Master (tests/support/k8s_operator.py), KubeRay's `wait-gcs-ready` and its submitter pod
(tests/support/kuberay_pods.py), the TrainJob's nodes as Trainer v2 and JobSet make them (tests/support/trainer_v2.py;
the torch-distributed runtime of Trainer 2.3 has no initializer jobs).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path, PurePosixPath

import kubernetes_validate
import pytest
import yaml

from tests.support.k8s_manifests import K8S_DIR, KUSTOMIZATIONS, SOURCES, TRAINJOB_SOURCES, Obj, of_kind, render
from tests.support.k8s_operator import pod_plans
from tests.support.kuberay_pods import rayjob_pods
from tests.support.pod_security import BASELINE, RESTRICTED, restricted_violations, strictest_profile, violations
from tests.support.trainer_v2 import pod_plans as trainer_v2_pods

RAYJOB_SOURCES = ("k8s/ray", "k8s/overlays/rayjob-streamed-data")
OPERATOR_COMPONENT = K8S_DIR / "components" / "restricted-init-container"
# training-operator v1.9's --pytorch-init-container-template-file default (pkg/config/config.go).
TEMPLATE_FILE = PurePosixPath("/etc/config/initContainer.yaml")


def operator_install(tmp_path: Path) -> list[Obj]:
    """k8s/operator as kustomize renders it, with the release's Deployment (fetched from GitHub there) replaced by
    one of the same name, namespace and container: the component's patch and generated ConfigMap are what is read.
    kustomize takes no absolute path to a component: the component is copied beside it."""
    shutil.copytree(OPERATOR_COMPONENT, tmp_path / "component")
    (tmp_path / "deployment.yaml").write_text(yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "training-operator"},
        "spec": {"selector": {"matchLabels": {"app": "training-operator"}},
                 "template": {"metadata": {"labels": {"app": "training-operator"}},
                              "spec": {"containers": [{"name": "training-operator", "image": "operator"}]}}}}))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "kubeflow",
        "resources": ["deployment.yaml"], "components": ["component"]}))
    return render(tmp_path.name, tmp_path.parent)


@pytest.fixture(scope="module")
def init_container_template(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The init container template the operator installed by k8s/operator reads."""
    (config_map,) = of_kind(operator_install(tmp_path_factory.mktemp("operator")), "ConfigMap")
    return config_map["data"][TEMPLATE_FILE.name]


def pods_of(source: str, init_container_template: str) -> dict[str, Obj]:
    """Each distinct pod the source's objects lead to, by name, as its controller creates it."""
    pods = {}
    for obj in render(source):
        if obj["kind"] == "PyTorchJob":
            pods.update({plan.name: plan.template for plan in pod_plans(obj, init_container_template)})
        elif obj["kind"] == "TrainJob":
            pods.update({plan.name: plan.template for plan in trainer_v2_pods(obj)})
        elif obj["kind"] == "RayJob":
            pods.update(rayjob_pods(obj))
        elif obj["kind"] in ("Deployment", "StatefulSet", "Job"):
            pods[f"{obj['kind']} {obj['metadata']['name']}"] = obj["spec"]["template"]
    return pods


@pytest.mark.parametrize("source", (*SOURCES, *RAYJOB_SOURCES))
def test_every_pod_the_operators_create_is_admitted_by_the_restricted_profile(source, init_container_template):
    pods = pods_of(source, init_container_template)
    assert pods, f"{source} leads to no pod"
    assert {name: restricted_violations(pod["spec"]) for name, pod in pods.items()} == {name: [] for name in pods}


def test_the_stock_training_operator_s_init_container_is_refused_so_k8s_operator_replaces_it():
    (job,) = of_kind(render("k8s/base"), "PyTorchJob")
    master, worker = pod_plans(job)  # the operator's built-in template
    assert restricted_violations(master.template["spec"]) == []
    violations = restricted_violations(worker.template["spec"])
    expected = ("allowPrivilegeEscalation: container 'init-pytorch' must set "
                "securityContext.allowPrivilegeEscalation=false")
    assert expected in violations, violations


def test_kuberay_s_default_submitter_is_refused_so_the_rayjob_brings_its_own():
    (rayjob,) = of_kind(render("k8s/ray"), "RayJob")
    del rayjob["spec"]["submitterPodTemplate"]
    violations = restricted_violations(rayjob_pods(rayjob)["submitter"]["spec"])
    assert "runAsNonRoot: pod or container 'ray-job-submitter' must set securityContext.runAsNonRoot=true" \
        in violations, violations


def test_the_operator_install_mounts_its_init_container_template_where_the_operator_reads_it(tmp_path):
    objects = operator_install(tmp_path)
    (deployment,) = of_kind(objects, "Deployment")
    (config_map,) = of_kind(objects, "ConfigMap")
    assert deployment["metadata"]["namespace"] == config_map["metadata"]["namespace"] == "kubeflow"
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(TEMPLATE_FILE.parent)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"], "the generated name, hash included"
    assert set(config_map["data"]) == {TEMPLATE_FILE.name}
    install = yaml.safe_load((K8S_DIR / "operator" / "kustomization.yaml").read_text())
    assert install["resources"] == ["github.com/kubeflow/trainer.git/manifests/overlays/standalone?ref=v1.9.4"]
    assert install["namespace"] == "kubeflow"
    assert (K8S_DIR / "operator" / install["components"][0]).resolve() == OPERATOR_COMPONENT


def test_the_configured_init_container_is_a_valid_container_that_waits_for_the_master(init_container_template):
    (job,) = of_kind(render("k8s/base"), "PyTorchJob")
    _, worker = pod_plans(job, init_container_template)
    (init,) = worker.template["spec"]["initContainers"]
    assert init["name"] == "init-pytorch" and "ddp-train-master-0" in init["command"][-1]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "worker"},
                                  "template": worker.template}, kubernetes_validate.latest_version(), strict=True)


def test_the_pod_security_sources_cover_every_kustomization():
    assert set(KUSTOMIZATIONS) | {"k8s/ray", "k8s/overlays/rayjob-streamed-data"} == {
        str(path.parent.relative_to(K8S_DIR.parent)) for path in K8S_DIR.rglob("kustomization.yaml")
        if "kind: Kustomization" in path.read_text() and path.parent.name != "operator"
        and "storage" not in path.parent.relative_to(K8S_DIR).parts}  # k8s/storage: a claim, no pods
    assert set(TRAINJOB_SOURCES) <= set(SOURCES)


# --- the checker itself: each rule refuses what its check refuses --------------------------------------------

ADMITTED = {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
            "initContainers": [{"name": "init", "securityContext": {"allowPrivilegeEscalation": False,
                                                                    "capabilities": {"drop": ["ALL"]}}}],
            "containers": [{"name": "main", "ports": [{"containerPort": 80}],
                            "securityContext": {"allowPrivilegeEscalation": False,
                                                "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]}


def _set(pod: Obj, path: str, value: object) -> Obj:
    pod = copy.deepcopy(pod)
    *keys, last = path.split(".")
    target = pod
    for key in keys:
        target = target[int(key)] if isinstance(target, list) else target.setdefault(key, {})
    if value is None:
        del target[last]
    else:
        target[int(last) if isinstance(target, list) else last] = value
    return pod


BREAKS = [
    ("allowPrivilegeEscalation", "initContainers.0.securityContext.allowPrivilegeEscalation", None),
    ("capabilities_restricted", "initContainers.0.securityContext.capabilities.drop", ["NET_RAW"]),
    ("capabilities_restricted", "containers.0.securityContext.capabilities.add", ["SYS_ADMIN"]),
    ("runAsNonRoot", "securityContext.runAsNonRoot", None),
    ("runAsNonRoot", "containers.0.securityContext.runAsNonRoot", False),
    ("runAsUser", "initContainers.0.securityContext.runAsUser", 0),
    ("seccompProfile_restricted", "securityContext.seccompProfile", {"type": "Unconfined"}),
    ("seccompProfile_restricted", "containers.0.securityContext.seccompProfile", {"type": "Unconfined"}),
    ("restrictedVolumes", "volumes.0", {"name": "data", "hostPath": {"path": "/data"}}),
    ("restrictedVolumes", "volumes.0", {"name": "data", "nfs": {"server": "nfs", "path": "/"}}),
    ("privileged", "containers.0.securityContext.privileged", True),
    ("hostNamespaces", "hostNetwork", True),
    ("hostPorts", "containers.0.ports.0.hostPort", 80),
    ("windowsHostProcess", "securityContext.windowsOptions", {"hostProcess": True}),
    ("procMount", "containers.0.securityContext.procMount", "Unmasked"),
    ("seLinuxOptions", "securityContext.seLinuxOptions", {"type": "spc_t"}),
    ("sysctls", "securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}]),
]


def test_the_admitted_example_is_admitted():
    assert restricted_violations(ADMITTED) == []


@pytest.mark.parametrize(("check", "path", "value"), BREAKS)
def test_each_rule_refuses_a_pod_that_breaks_it(check, path, value):
    pod = _set(ADMITTED, path, value)  # None: the field removed
    assert [v for v in restricted_violations(pod) if v.startswith(f"{check}: ")], restricted_violations(pod)


def test_every_rule_has_a_pod_that_breaks_it():
    assert {check for check, _, _ in BREAKS} == set(RESTRICTED)


# Baseline's own checks, where it is laxer than restricted: each refuses what baseline refuses, and passes what
# only restricted refuses.
BASELINE_BREAKS = [
    ("privileged", "containers.0.securityContext.privileged", True),
    ("hostNamespaces", "hostIPC", True),
    ("hostPathVolumes", "volumes.0", {"name": "data", "hostPath": {"path": "/data"}}),
    ("hostPorts", "containers.0.ports.0.hostPort", 80),
    ("windowsHostProcess", "securityContext.windowsOptions", {"hostProcess": True}),
    ("procMount", "containers.0.securityContext.procMount", "Unmasked"),
    ("seLinuxOptions", "securityContext.seLinuxOptions", {"type": "spc_t"}),
    ("sysctls", "securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}]),
    ("capabilities_baseline", "containers.0.securityContext.capabilities.add", ["IPC_LOCK"]),
    ("seccompProfile_baseline", "securityContext.seccompProfile", {"type": "Unconfined"}),
]


@pytest.mark.parametrize(("check", "path", "value"), BASELINE_BREAKS)
def test_each_baseline_rule_refuses_a_pod_that_breaks_it(check, path, value):
    pod = _set(ADMITTED, path, value)
    assert [v for v in violations(pod, "baseline") if v.startswith(f"{check}: ")], violations(pod, "baseline")
    assert strictest_profile(pod) == "privileged"


def test_every_baseline_rule_has_a_pod_that_breaks_it():
    assert {check for check, _, _ in BASELINE_BREAKS} == set(BASELINE)


@pytest.mark.parametrize("path", ["securityContext.runAsNonRoot", "initContainers.0.securityContext.capabilities",
                                  "containers.0.securityContext.allowPrivilegeEscalation"])
def test_a_pod_only_restricted_refuses_is_baseline(path):
    pod = _set(ADMITTED, path, None)
    assert restricted_violations(pod) != [] and strictest_profile(pod) == "baseline"


def test_a_capability_baseline_allows_is_baseline_and_ipc_lock_is_privileged():
    assert strictest_profile(ADMITTED) == "restricted"
    assert strictest_profile(_set(ADMITTED, "containers.0.securityContext.capabilities.add", ["CHOWN"])) == "baseline"
    assert strictest_profile(_set(ADMITTED, "containers.0.securityContext.capabilities.add", ["IPC_LOCK"])) \
        == "privileged"
