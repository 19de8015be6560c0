"""Prometheus scrapes the trainer (k8s/components/prometheus, docs/kubernetes.md "Prometheus"): over every variant
of each kind of job, as a user's overlay renders it, each trainer pod runs the trainer with --metrics-port 19400 and
is exactly one target of the job's PodMonitor at that port, which the CRD's schema accepts (tests/support/
prometheus_operator.py); the network policies let Prometheus in on that port alone; each job, renamed, is its own."""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support.job_pods import the_job
from tests.support.k8s_manifests import K8S_DIR, Obj, config_maps, of_kind, render, user_overlay
from tests.support.k8s_operator import pod_plans as pytorchjob_pods
from tests.support.k8s_pods import pod_command
from tests.support.kubeflow_api import CHECKS, api_errors
from tests.support.kuberay_api import pod_template_errors, rayjob_errors
from tests.support.kuberay_pods import rayjob_pods
from tests.support.network_policy import Pod, admitted
from tests.support.prometheus_operator import podmonitor_errors, targets
from tests.support.trainer_v2 import pod_plans as trainjob_pods
from trainer.cli import parse_config
from trainer.on_ray import ray_parser

COMPONENT, PORT = "prometheus", 19400
# The torch plugin's port on every TrainJob node container (kubeflow/trainer v2.3.0, pkg/runtime/framework/plugins/
# torch/torch.go: apply.UpsertPort of constants.ContainerTrainerPort), which tests/support/trainer_v2.py leaves out.
TORCH_PLUGIN_PORT = {"containerPort": 29500, "protocol": "TCP"}
# Each kind of job, and variants that change what the component patches (the trainer's flags, its pods' ports).
OVER = ("k8s/base", "k8s/overlays/sharded", "k8s/overlays/gpu-multi-node", "k8s/trainer-v2",
        "k8s/overlays/trainjob-gpu", "k8s/ray", "k8s/overlays/rayjob-streamed-data")
INSIDE = ("k8s/overlays/gpu-single-node", "k8s/overlays/elastic")  # they remove a replica in their own patches
INIT_CONTAINER = (K8S_DIR / "components" / "restricted-init-container" / "initContainer.yaml").read_text()
PROMETHEUS = Pod({"app.kubernetes.io/name": "prometheus", "app.kubernetes.io/managed-by": "prometheus-operator"},
                 namespace="monitoring")


def inside(tmp_path: Path, source: str) -> list[Obj]:
    """The variant, in a copy of k8s/, with the component listed last among its own components."""
    shutil.copytree(K8S_DIR, tmp_path / "k8s", symlinks=True)
    path = tmp_path / source / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    kustomization.setdefault("components", []).append(f"../../components/{COMPONENT}")
    path.write_text(yaml.safe_dump(kustomization))
    return render(source, tmp_path)


@dataclass(frozen=True)
class JobPod:
    name: str
    labels: dict[str, str]
    template: Obj
    ports: list[Obj]  # every port its containers declare, those the operator adds included
    command: list[str] | None  # the trainer's; None where no rank runs (a RayJob's head and submitter)


def declared(template: Obj) -> list[Obj]:
    return [port for container in template["spec"]["containers"] for port in container.get("ports", [])]


def pods(job: Obj) -> list[JobPod]:
    """Each pod the job's operator creates."""
    if job["kind"] == "PyTorchJob":
        return [JobPod(plan.name, dict(plan.labels), plan.template, declared(plan.template), pod_command(plan))
                for plan in pytorchjob_pods(job, INIT_CONTAINER)]
    if job["kind"] == "TrainJob":
        return [JobPod(plan.name, dict(plan.labels), plan.template, [*declared(plan.template), TORCH_PLUGIN_PORT],
                       pod_command(plan)) for plan in trainjob_pods(job)]
    # The driver runs on the head and hands its trainer flags to every worker's trainer (trainer.on_ray).
    command = shlex.split(job["spec"]["entrypoint"])
    _, trainer_args = ray_parser().parse_known_args(command[1:])
    return [JobPod(kind, template["metadata"].get("labels", {}), template, declared(template),
                   ["ddp-train", *trainer_args] if kind.startswith("worker:") else None)
            for kind, template in rayjob_pods(job).items()]


def metrics_port(objects: list[Obj], template: Obj, command: list[str], tmp_path: Path) -> int:
    """--metrics-port as the trainer in the pod reads it: its flags over the config file its volume mounts."""
    mounted = {mount["mountPath"]: mount["name"] for container in template["spec"]["containers"]
               for mount in container.get("volumeMounts", [])}
    volumes = {volume["name"]: volume for volume in template["spec"]["volumes"]}
    config_path = Path(command[command.index("--config") + 1])
    config_map = config_maps(objects)[volumes[mounted[str(config_path.parent)]]["configMap"]["name"]]
    (tmp_path / "config.yaml").write_text(config_map[config_path.name])
    flags = command[command.index("--config") + 2:]
    return parse_config(["--config", str(tmp_path / "config.yaml"), *flags])[0].output.metrics_port


def assert_every_trainer_pod_is_scraped_once(objects: list[Obj], tmp_path: Path) -> None:
    job = the_job(objects)
    (monitor,) = of_kind(objects, "PodMonitor")
    assert podmonitor_errors(monitor) == []
    policies = of_kind(objects, "NetworkPolicy")
    trainers = 0
    for pod in pods(job):
        if pod.command is None:  # the RayJob's head and submitter: no rank runs there
            assert targets(monitor, pod.labels, pod.ports) == [], pod.name
            continue
        trainers += 1
        assert metrics_port(objects, pod.template, pod.command, tmp_path) == PORT, pod.name
        assert targets(monitor, pod.labels, pod.ports) == [f"10.0.0.7:{PORT}"], pod.name
        target = Pod(pod.labels, namespace="default")
        assert admitted(policies, PROMETHEUS, target, PORT), pod.name
        # The metrics port alone: the rendezvous, the collectives' and Ray's ports stay the job's own.
        for other in (23456, 29500, 6379, 8265, 41000):
            assert not admitted(policies, PROMETHEUS, target, other), (pod.name, other)
        assert not admitted(policies, Pod({"app": "web"}, namespace="web"), target, PORT), pod.name
    assert trainers >= 1
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CHECKS:
            assert api_errors(obj) == [], obj["kind"]
        elif obj["kind"] == "RayJob":
            assert rayjob_errors(obj) == [] and pod_template_errors(obj, kubernetes_validate.latest_version()) == []
        elif obj["kind"] == "NetworkPolicy":
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("source", OVER)
def test_every_trainer_pod_of_a_variant_is_one_target_of_its_podmonitor(source, tmp_path):
    assert_every_trainer_pod_is_scraped_once(user_overlay(tmp_path, source, [COMPONENT]), tmp_path)


@pytest.mark.parametrize("source", INSIDE)
def test_a_variant_with_one_replica_lists_the_component_among_its_own(source, tmp_path):
    assert_every_trainer_pod_is_scraped_once(inside(tmp_path, source), tmp_path)


@pytest.mark.parametrize("source", ["k8s/base", "k8s/trainer-v2", "k8s/ray"])
def test_two_renamed_jobs_in_one_namespace_are_scraped_each_by_its_own_podmonitor(source, tmp_path):
    jobs = {}
    for prefix in ("team-a-", "team-b-"):
        (tmp_path / prefix).mkdir()
        objects = user_overlay(tmp_path / prefix, source, [COMPONENT], prefix)
        (monitor,) = of_kind(objects, "PodMonitor")
        jobs[prefix] = (monitor, pods(the_job(objects)))
    for prefix, (monitor, _) in jobs.items():
        assert monitor["metadata"]["name"] == f"{prefix}ddp-train"
        for other, (_, job_pods) in jobs.items():
            scraped = [pod.name for pod in job_pods if pod.command is not None and targets(monitor, pod.labels,
                                                                                            pod.ports)]
            assert bool(scraped) == (other == prefix), (prefix, other, scraped)


def test_without_the_component_nothing_listens_and_nothing_is_scraped(tmp_path):
    for source in ("k8s/base", "k8s/trainer-v2", "k8s/ray"):
        objects = render(source)
        assert not of_kind(objects, "PodMonitor")
        for pod in pods(the_job(objects)):
            if pod.command is not None:
                assert metrics_port(objects, pod.template, pod.command, tmp_path) == 0, (source, pod.name)


@pytest.mark.parametrize(("change", "error"), [
    ({"podMetricsEndpoints": [{"prot": "metrics"}]}, "'prot' was unexpected"),
    ({"podMetricsEndpoints": [{"portNumber": "29500"}]}, "'29500' is not of type 'integer'"),
    ({"podMetricsEndpoints": [{"portNumber": 70000}]}, "70000 is greater than the maximum of 65535"),
])
def test_a_misspelled_or_mistyped_field_of_the_podmonitor_is_an_error(change, error, tmp_path):
    (monitor,) = of_kind(user_overlay(tmp_path, "k8s/base", [COMPONENT]), "PodMonitor")
    monitor["spec"].update(change)
    assert any(error in problem for problem in podmonitor_errors(monitor)), podmonitor_errors(monitor)


@pytest.mark.parametrize("order", [[COMPONENT, "workload-identity-aks"], ["workload-identity-aks", COMPONENT]])
def test_a_trainjobs_pods_keep_every_components_labels_in_any_order(order, tmp_path):
    """Both components add their label to the runtime patch's labels (k8s/trainer-v2/trainjob.yaml), neither replaces
    the other's."""
    for pod in pods(the_job(user_overlay(tmp_path, "k8s/trainer-v2", order))):
        assert pod.labels["azure.workload.identity/use"] == "true", pod.name
        assert pod.labels["app.kubernetes.io/instance"] == "ddp-train", pod.name
