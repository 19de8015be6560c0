"""k8s/ray: ddp-train-ray as a KubeRay RayJob, as `kubectl apply -k k8s/ray` sends it, checked against KubeRay's
API and Kubernetes' pod schema (tests/support/kuberay_api.py), for what the trainer needs of it, and for what
KubeRay does with it (tests/support/kuberay_pods.py, each release named): the probes and commands it runs in the
pods, its retries, its worker group's size. A real Ray head and worker answer the probes the manifest gives."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import kubernetes_validate
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from devtools.processes import BIN_DIR, REPO_ROOT, clean_env, descendants, free_port, marked
from tests.support.k8s_manifests import Obj, config_maps, of_kind, render
from tests.support.kuberay_api import pod_template_errors, pod_templates, rayjob_errors
from tests.support.kuberay_pods import KUBERAY_RELEASES, OLDEST, UNIFIED_HEALTH_SINCE_RAY, KubeRay, rayjob_pods
from trainer.cli import parse_config
from trainer.config import Config
from trainer.on_ray import ray_parser
from trainer.task import RunTask

SOURCE = "k8s/ray"
STREAMED_DATA = "k8s/overlays/rayjob-streamed-data"  # the RayJob reading its data from an object store
KUBERNETES_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())


def rayjob(source: str = SOURCE) -> Obj:
    (job,) = of_kind(render(source), "RayJob")
    return job


def containers(job: Obj) -> dict[str, Obj]:
    """The Ray cluster's containers (the head's, each worker group's) with their pods' volumes; the submitter pod
    only sends the entrypoint to the dashboard: it mounts nothing and reads no store."""
    return {container["name"]: {**container, "volumes": template["spec"].get("volumes", [])}
            for path, template in pod_templates(job) if "submitterPodTemplate" not in path
            for container in template["spec"]["containers"]}


@pytest.mark.parametrize("source", [SOURCE, STREAMED_DATA])
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_passes_its_schema_strictly(version, source):
    for obj in render(source):
        if obj["kind"] == "RayJob":
            assert rayjob_errors(obj) == [] and pod_template_errors(obj, version) == []
        else:
            kubernetes_validate.validate(obj, version, strict=True)
    kinds = sorted(obj["kind"] for obj in render(source))
    assert kinds == ["ConfigMap", "NetworkPolicy", "PersistentVolumeClaim", "PodDisruptionBudget", "RayJob",
                     "ServiceAccount"]


@pytest.mark.parametrize(("path", "change", "error"), [
    (("spec",), {"entrypont": "x"}, "'entrypont' was unexpected"),
    (("spec",), {"backoffLimit": "2"}, "spec.backoffLimit: '2' is not of type 'integer'"),
    (("spec", "rayClusterSpec", "workerGroupSpecs", 0), {"replica": 2}, "'replica' was unexpected"),
])
def test_a_misspelled_or_mistyped_field_of_the_rayjob_is_an_error(path, change, error):
    job = rayjob()
    target = job
    for key in path:
        target = target[key]
    target.update(change)
    assert any(error in problem for problem in rayjob_errors(job)), rayjob_errors(job)


def test_a_second_env_entry_of_one_name_in_a_pod_template_is_refused():
    """KubeRay's CRD keeps Kubernetes' list types inside its pod templates, and the API server checks them there:
    two env entries of one name are refused, though Kubernetes' pod schema (kubernetes-validate) lets them pass."""
    job = rayjob()
    (head,) = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    env = head.setdefault("env", [])
    env += [{"name": "AWS_ACCESS_KEY_ID", "value": "a"}, {"name": "AWS_ACCESS_KEY_ID", "value": "b"}]
    assert rayjob_errors(job) == [f"spec.rayClusterSpec.headGroupSpec.template.spec.containers.0.env.{len(env) - 1}: "
                                  f'Duplicate value: {{"name": "AWS_ACCESS_KEY_ID"}} (item {len(env) - 2} has it)']


def entrypoint_config(source: str, tmp_path: Path) -> tuple[Obj, argparse.Namespace, Config, RunTask]:
    """The RayJob, Ray's options of its entrypoint, and the trainer's config and task as the workers parse them
    (the ConfigMap's config and the entrypoint's flags)."""
    job = rayjob(source)
    command = shlex.split(job["spec"]["entrypoint"])
    assert command[0] == "ddp-train-ray"
    ray_args, trainer_args = ray_parser().parse_known_args(command[1:])
    config_path = Path(trainer_args[trainer_args.index("--config") + 1])
    (tmp_path / "config.yaml").write_text(config_maps(render(source))["ddp-train-config"][config_path.name])
    trainer_args[trainer_args.index("--config") + 1] = str(tmp_path / "config.yaml")
    return job, ray_args, *parse_config(trainer_args)


@pytest.mark.parametrize("source", [SOURCE, STREAMED_DATA])
def test_the_entrypoint_is_a_valid_ddp_train_ray_command_on_the_configmaps_config(source: str, tmp_path: Path):
    job, ray_args, config, _ = entrypoint_config(source, tmp_path)
    command = shlex.split(job["spec"]["entrypoint"])
    config_path = Path(command[command.index("--config") + 1])
    assert config.train.global_batch_size, "the same optimisation at any worker count Ray gives the run"
    assert config.checkpoint.checkpoint_every_s > 0, "a worker group Ray stops loses at most that much training"
    # Each trainer worker fits one worker pod; the run grows no larger than the group.
    group = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    worker = containers(job)["ray-worker"]
    assert float(worker["resources"]["limits"]["cpu"]) == ray_args.ray_cpus_per_worker
    assert ray_args.ray_workers[1] <= group["replicas"]
    assert job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    # The run's folder and the trainer's config are on volumes the head (the driver) and every worker mount.
    for container in containers(job).values():
        mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
        volumes = {volume["name"]: volume for volume in container["volumes"]}
        storage = next(volumes[name] for path, name in mounts.items()
                       if ray_args.ray_storage_path.startswith(path + "/"))
        assert storage["persistentVolumeClaim"]["claimName"] == "ddp-train-storage", container["name"]
        assert "configMap" in volumes[mounts[str(config_path.parent)]], container["name"]
    (claim,) = of_kind(render(source), "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "worker pods on several nodes share it"


def test_the_streamed_data_rayjob_reads_shards_with_optional_credentials_and_a_cache_per_worker_pod(tmp_path: Path):
    _, _, plain, _ = entrypoint_config(SOURCE, tmp_path)
    job, _, config, task = entrypoint_config(STREAMED_DATA, tmp_path)
    assert task.options.dataset == "shards" and task.options.data_dir.startswith("s3://")
    assert (config.train, config.dist, config.checkpoint) == (plain.train, plain.dist, plain.checkpoint)
    for name, container in containers(job).items():
        env = {item["name"]: item for item in container["env"]}
        # The driver (on the head) and every worker: from a Secret, optional (pods with access of their own).
        for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
            assert env[variable]["valueFrom"]["secretKeyRef"] == {"name": "data-credentials", "key": variable,
                                                                  "optional": True}, name
    worker = containers(job)["ray-worker"]
    volumes = {volume["name"]: volume for volume in worker["volumes"]}
    (mount,) = [mount for mount in worker["volumeMounts"] if mount["mountPath"] == config.data.shard_cache_dir]
    cache = volumes[mount["name"]]["emptyDir"]
    size = int(cache["sizeLimit"].removesuffix("Gi")) * 2**30
    assert "medium" not in cache, "the cache is on the node's disk, not in the pod's memory"
    assert 1.1 * config.data.shard_cache_gb * 1e9 <= size <= 1.5 * config.data.shard_cache_gb * 1e9
    assert worker["resources"]["requests"]["ephemeral-storage"] == cache["sizeLimit"], "scheduled where it fits"


def test_the_rayjobs_pods_run_without_privileges_and_its_image_is_the_one_every_manifest_names():
    job = rayjob()
    for _, template in pod_templates(job):
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
        assert template["spec"]["automountServiceAccountToken"] is False
    for container in containers(job).values():
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["image"] == "ddp-deploy:latest"  # k8s/components/image's reference


# What the image can run by name: bash, its builtins, coreutils and grep of its Debian slim base (docker/Dockerfile's
# BASE_IMAGE, python:3.11-slim-bookworm, which has no wget and no curl), the venv's python, and the console scripts
# of Ray and of this package (pip puts them in /opt/venv/bin, first on PATH).
BASE_PROGRAMS = {"bash", "sh", "/bin/bash", "/bin/sh", "echo", "ulimit", "test", "true", "false", "exit", "sleep",
                 "cat", "grep", "python", "python3"}
SHELL_KEYWORDS = {"if", "then", "else", "elif", "fi", "until", "while", "do", "done", "!", "{", "}"}
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")"}


def image_programs() -> set[str]:
    scripts = {entry.name for name in ("ray", "ddp-deploy")
               for entry in importlib.metadata.distribution(name).entry_points if entry.group == "console_scripts"}
    return BASE_PROGRAMS | scripts


def shell_programs(script: str) -> list[str]:
    """The programs a shell script runs: each command's first word (keywords, redirections and arguments skipped)."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    programs, expect_command, skip_next = [], True, False
    for token in lexer:
        if skip_next:
            skip_next = False
        elif token in SEPARATORS:
            expect_command = True
        elif token[0] in "<>":
            skip_next = True  # the redirection's target
        elif expect_command and token in SHELL_KEYWORDS:
            continue
        elif expect_command:
            programs.append(token)
            expect_command = False
    return programs


def command_programs(command: list[str]) -> list[str]:
    """The programs an exec'd command line runs: a shell's own script's too (bash -c, -ce, -lc ...)."""
    if Path(command[0]).name in ("bash", "sh") and len(command) > 2 and command[1].startswith("-") \
            and "c" in command[1]:
        script = next(word for word in command[2:] if word != "--")
        return [command[0], *shell_programs(script)]
    return command[:1]


def what_kuberay_runs(pod: Obj) -> Iterator[tuple[str, list[str]]]:
    """(where, command) of every command line KubeRay's pod execs in the image: each container's command and args,
    each exec probe's. An httpGet probe is the kubelet's, and needs nothing of the image."""
    for container in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]:
        if "command" in container:
            yield container["name"], [*container["command"], *container.get("args", [])]
        for field in ("readinessProbe", "livenessProbe", "startupProbe"):
            if "exec" in container.get(field, {}):
                yield f"{container['name']} {field}", container[field]["exec"]["command"]


@pytest.mark.parametrize("kuberay", KUBERAY_RELEASES, ids=lambda release: release.tag)
@pytest.mark.parametrize("source", [SOURCE, STREAMED_DATA])
def test_every_command_kuberay_runs_in_the_rayjobs_pods_is_one_the_image_has(source: str, kuberay: KubeRay):
    """Probes included: KubeRay keeps the ones the manifest gives the Ray containers, in every release named."""
    job = rayjob(source)
    programs = image_programs()
    missing = {where: sorted(set(command_programs(command)) - programs)
               for pod in rayjob_pods(job, kuberay).values() for where, command in what_kuberay_runs(pod)}
    assert {where: names for where, names in missing.items() if names} == {}
    for kind, pod in rayjob_pods(job, kuberay).items():
        if kind != "submitter":
            ray = pod["spec"]["containers"][0]
            manifest = next(container for path, template in pod_templates(job) if "submitterPodTemplate" not in path
                            for container in template["spec"]["containers"] if container["name"] == ray["name"])
            assert (ray["readinessProbe"], ray["livenessProbe"]) == \
                (manifest["readinessProbe"], manifest["livenessProbe"]), kind


def test_kuberay_v1_5_s_own_probes_exec_wget_which_the_image_has_not_so_the_manifest_gives_its_own():
    job = rayjob()
    for template in (job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"],
                     *(group["template"] for group in job["spec"]["rayClusterSpec"]["workerGroupSpecs"])):
        for field in ("readinessProbe", "livenessProbe"):
            del template["spec"]["containers"][0][field]
    head = rayjob_pods(job, OLDEST)["head"]["spec"]["containers"][0]
    assert set(command_programs(head["readinessProbe"]["exec"]["command"])) - image_programs() == {"wget"}


def ray_containers(job: Obj) -> dict[str, tuple[Obj, Obj]]:
    """Each Ray container (the head's, each worker group's) with its group's rayStartParams."""
    cluster = job["spec"]["rayClusterSpec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return {group["template"]["spec"]["containers"][0]["name"]: (group["template"]["spec"]["containers"][0],
                                                                 group.get("rayStartParams", {}))
            for group in groups}


HEALTH_PATH = "/api/healthz"


@pytest.mark.parametrize("source", [SOURCE, STREAMED_DATA])
def test_the_probes_ask_each_nodes_dashboard_agent_for_its_health_on_the_port_ray_gives_it(source: str):
    from ray._private.ray_constants import DEFAULT_DASHBOARD_AGENT_LISTEN_PORT

    for name, (container, params) in ray_containers(rayjob(source)).items():
        agent_port = int(params.get("dashboard-agent-listen-port", DEFAULT_DASHBOARD_AGENT_LISTEN_PORT))
        for field in ("readinessProbe", "livenessProbe"):
            assert container[field]["httpGet"] == {"path": HEALTH_PATH, "port": agent_port}, (name, field)
    # The agent's /api/healthz (the raylet's health and, on the head, the GCS's) is Ray 2.53's and newer.
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = [Requirement(item) for item in extras["ray"] if Requirement(item).name == "ray"]
    lowest = [Version(clause.version) for clause in requirement.specifier if clause.operator in (">=", "==", "~=")]
    assert lowest and min(lowest) >= UNIFIED_HEALTH_SINCE_RAY, requirement


@contextlib.contextmanager
def ray_node(options: list[str], env: dict[str, str], mark: str) -> Iterator[None]:
    """`ray start` on loopback with ports of its own (other Ray clusters may run on this machine), its processes
    marked and killed at the end (Ray's workers and agents set their titles over their environment: their parents
    are marked, and everything under them goes too)."""
    command = [str(BIN_DIR / "ray"), "start", *options, "--node-ip-address=127.0.0.1", "--disable-usage-stats",
               f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
               f"--metrics-export-port={free_port()}"]
    try:
        started = subprocess.run(command, env=clean_env({**env, "DDP_DEVTOOLS_MARK": mark}), capture_output=True,
                                 text=True, timeout=180)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        yield
    finally:
        for process in [child for pid in marked(mark) for child in descendants(pid)]:
            with contextlib.suppress(OSError):
                os.kill(process, signal.SIGKILL)


def answer(url: str, deadline_s: float) -> tuple[int, str]:
    """The HTTP status and body at `url`, asked until something listens there (as the kubelet asks again)."""
    give_up = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
        except OSError:
            if time.monotonic() > give_up:
                raise
            time.sleep(0.5)


@pytest.mark.slow
def test_a_ray_head_and_worker_with_token_authentication_answer_the_probes_without_the_token():
    """With token authentication on as KubeRay sets it (RAY_AUTH_MODE=token, the token in every Ray container),
    each node's agent answers the manifest's probe path 200 without the token, the head's with its GCS healthy too,
    where the head's job API refuses a request without it."""
    containers = ray_containers(rayjob())
    assert {container["readinessProbe"]["httpGet"]["path"] for container, _ in containers.values()} == {HEALTH_PATH}
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "RAY_USAGE_STATS_ENABLED": "0"}
    gcs, dashboard, head_agent, worker_agent = free_port(), free_port(), free_port(), free_port()
    # Short: Ray's sockets live under it, and a socket path may be at most 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="ddpprobe-", dir="/tmp")
    mark = f"rayjob-probes-{gcs}"
    try:
        with ray_node(["--head", f"--port={gcs}", "--num-cpus=0", "--include-dashboard=true",
                       "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                       f"--dashboard-agent-listen-port={head_agent}", f"--temp-dir={temp_dir}"], env, mark), \
                ray_node([f"--address=127.0.0.1:{gcs}", "--num-cpus=1",
                          f"--dashboard-agent-listen-port={worker_agent}"], env, f"{mark}-worker"):
            head = answer(f"http://127.0.0.1:{head_agent}{HEALTH_PATH}", 120)
            worker = answer(f"http://127.0.0.1:{worker_agent}{HEALTH_PATH}", 120)
            jobs = answer(f"http://127.0.0.1:{dashboard}/api/jobs/", 120)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert head == (200, "raylet: success\ngcs: success")
    assert worker == (200, "raylet: success\ngcs: success (no local gcs)")
    assert jobs[0] == 401, jobs


@pytest.mark.parametrize("source", [SOURCE, STREAMED_DATA])
def test_the_worker_group_has_a_fixed_size_and_no_autoscaling_is_half_offered(source: str, tmp_path: Path):
    """KubeRay's autoscaler is off, where minReplicas and maxReplicas only bound `replicas` (utils.go,
    GetWorkerGroupDesiredReplicas): they equal it, and the driver does not count on nodes to come."""
    job, ray_args, _, _ = entrypoint_config(source, tmp_path)
    cluster = job["spec"]["rayClusterSpec"]
    assert not cluster.get("enableInTreeAutoscaling") and not ray_args.ray_cluster_autoscales
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"], group["groupName"]
    assert ray_args.ray_workers[1] <= sum(group["replicas"] for group in cluster["workerGroupSpecs"])


@pytest.mark.parametrize("source", [SOURCE, STREAMED_DATA])
def test_a_failed_rayjob_gets_no_new_cluster_and_ray_retries_failures_inside_the_one_it_has(source: str,
                                                                                              tmp_path: Path):
    """KubeRay retries a failed RayJob whatever its driver exited with (rayjob_controller.go,
    checkBackoffLimitAndUpdateStatusIfNeeded), each time on a new Ray cluster: an input error (exit 2) too."""
    job, ray_args, _, _ = entrypoint_config(source, tmp_path)
    assert job["spec"]["backoffLimit"] == 0
    assert ray_args.ray_max_failures > 0, "Ray restarts a failed worker group; the trainer resumes"
