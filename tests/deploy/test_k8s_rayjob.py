"""k8s/ray: ddp-train-ray as a KubeRay RayJob, as `kubectl apply -k k8s/ray` sends it, checked against KubeRay's
API and Kubernetes' pod schema (tests/support/kuberay_api.py), and for what the trainer needs of it."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import kubernetes_validate
import pytest

from tests.support.k8s_manifests import Obj, config_maps, of_kind, render
from tests.support.kuberay_api import pod_template_errors, pod_templates, rayjob_errors
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
    assert ray_args.ray_workers[1] <= group["maxReplicas"] and ray_args.ray_workers[0] >= group["minReplicas"]
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
