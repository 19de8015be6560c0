"""Kubeflow Trainer's Python SDK (PyPI ``kubeflow``): the trainer submitted with ``TrainerClient().train(...)``
(kubeflow_sdk/trainjob.py).

What the SDK would send a cluster is built by its own Kubernetes backend and compared with k8s/trainer-v2's
TrainJob; the same job then runs for real through the SDK's container backend on the Docker engine, two
containers of the trainer's image, and a bad flag comes back as the failed job's exit code and line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from devtools.processes import REPO_ROOT
from kubeflow_sdk.trainjob import cluster_job, ddp_trainer
from tests.support.k8s_manifests import config_maps, of_kind, render
from tests.support.preconditions import unavailable
from tests.support.trainer_crds import crd_errors
from tests.support.trainer_v2 import admission_errors

IMAGE = os.environ.get("IMAGE", "ddp-deploy:latest")
SMALL = ["--dataset", "synthetic", "--synthetic-train-size", "64", "--synthetic-test-size", "16", "--batch-size", "8",
         "--epochs", "1", "--progress", "off", "--output-dir", "/tmp/run"]


def manifest_job() -> tuple[dict, str]:
    """k8s/trainer-v2 as kubectl applies it: the TrainJob's trainer, and its config file's text."""
    objects = render("k8s/trainer-v2")
    (job,) = of_kind(objects, "TrainJob")
    return job["spec"]["trainer"], config_maps(objects)["ddp-train-config"]["config.yaml"]


def as_the_cluster_gets_it(custom_trainer) -> dict:
    """The TrainJob trainer the SDK's Kubernetes backend makes of it, under the torch-distributed runtime."""
    from kubeflow.trainer.backends.kubernetes import utils
    from kubeflow.trainer.constants import constants
    from kubeflow.trainer.types import types

    runtime = types.Runtime(name="torch-distributed", kind=types.RuntimeKind.CLUSTER_TRAINING_RUNTIME,
                            trainer=types.RuntimeTrainer(trainer_type=types.TrainerType.CUSTOM_TRAINER,
                                                         framework="torch", image="unused"))
    runtime.trainer.set_command(constants.TORCH_COMMAND)
    return utils.get_trainer_cr_from_custom_trainer(runtime, custom_trainer).to_dict()


def test_the_sdk_job_is_the_trainjob_that_k8s_trainer_v2_describes():
    manifest, config_yaml = manifest_job()
    limits = manifest["resourcesPerNode"]["limits"]
    sent = as_the_cluster_gets_it(ddp_trainer(config_yaml=config_yaml, image=manifest["image"],
                                              num_nodes=manifest["numNodes"], cpu=limits["cpu"],
                                              memory=limits["memory"]))
    assert sent["image"] == manifest["image"] and sent["numNodes"] == manifest["numNodes"] == 2
    assert sent["resourcesPerNode"] == manifest["resourcesPerNode"]
    env = {item["name"]: item.get("value") for item in sent["env"]}
    assert env["HOME"] == {item["name"]: item.get("value") for item in manifest["env"]}["HOME"] == "/tmp"
    assert env["OMP_NUM_THREADS"] == limits["cpu"], "the manifest's resourceFieldRef, as a value"
    # Each node runs torchrun on the function's source, called with the manifest's config file.
    script = sent["command"][-1]
    assert re.search(r'^torchrun "trainjob\.py"$', script, re.MULTILINE), script[-500:]
    assert f"ddp_train(**{{'argv': [], 'config_yaml': {config_yaml!r}, 'task': ''}})" in script


def sent_trainjob(trainer, options: list) -> dict:
    """The whole TrainJob the SDK's Kubernetes backend sends the API server for train(options=...), caught on its
    way (no cluster: the backend's train() builds it, its client would send it)."""
    from kubeflow.trainer.backends.kubernetes.backend import KubernetesBackend
    from kubeflow.trainer.constants import constants
    from kubeflow.trainer.types import types

    runtime = types.Runtime(name="torch-distributed", kind=types.RuntimeKind.CLUSTER_TRAINING_RUNTIME,
                            trainer=types.RuntimeTrainer(trainer_type=types.TrainerType.CUSTOM_TRAINER,
                                                         framework="torch", image="unused"))
    runtime.trainer.set_command(constants.TORCH_COMMAND)
    sent: list[dict] = []
    backend = KubernetesBackend.__new__(KubernetesBackend)  # its __init__ reads a kubeconfig
    backend.namespace = "default"
    backend.custom_api = SimpleNamespace(create_namespaced_custom_object=lambda *args: sent.append(args[-1]))
    backend.train(runtime=runtime, trainer=trainer, options=options)
    (trainjob,) = sent
    return trainjob


def node_pod(trainjob: dict) -> dict:
    """The pod template of the runtime patch's node job."""
    (patch,) = trainjob["spec"]["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    return node["template"]["spec"]["template"]


def test_a_cluster_job_has_the_manifests_label_deadline_pods_run_folder_and_lease_name():
    from kubeflow.trainer.options import PodSpecPatch

    (manifest,) = of_kind(render("k8s/trainer-v2"), "TrainJob")
    sent = sent_trainjob(**cluster_job("ddp-train", ["--epochs", "3"], namespace="team-a"))
    assert crd_errors(sent, "v2.3.0") == [] and admission_errors(sent) == []
    assert sent["metadata"]["name"] == "ddp-train" and sent["metadata"]["labels"] == manifest["metadata"]["labels"]
    assert sent["spec"]["activeDeadlineSeconds"] == manifest["spec"]["activeDeadlineSeconds"]
    pod, wanted = node_pod(sent), node_pod(manifest)
    assert pod["metadata"]["annotations"] == wanted["metadata"]["annotations"], "do-not-disrupt, no sidecar"
    for field in ("serviceAccountName", "securityContext"):
        assert pod["spec"][field] == wanted["spec"][field], field
    (container,), (wanted_container,) = pod["spec"]["containers"], wanted["spec"]["containers"]
    assert container["securityContext"] == wanted_container["securityContext"]
    # The config file travels in the function's arguments, not in the ConfigMap's volume; the SDK writes the
    # function's file in the working folder.
    assert [v for v in wanted["spec"]["volumes"] if v["name"] != "config"] == pod["spec"]["volumes"][:-1]
    assert [m for m in wanted_container["volumeMounts"] if m["name"] != "config"] == container["volumeMounts"][:-1]
    assert container["volumeMounts"][-1] == {"name": "workspace", "mountPath": "/workspace"}
    # What the SDK has no field for (docs/kubernetes.md): the grace period; the manifest's empty tolerations and
    # node selector are only there for components to add to.
    assert set(wanted["spec"]) - set(pod["spec"]) == {"terminationGracePeriodSeconds", "tolerations", "nodeSelector"}
    assert "termination_grace_period_seconds" not in PodSpecPatch.__dataclass_fields__
    assert wanted["spec"]["tolerations"] == [] and wanted["spec"]["nodeSelector"] == {}
    # The manifest's run folder and lease name, /mnt/ddp/$(DDP_JOB_NAME) and trainjob/NAMESPACE/NAME from the pod's
    # fields; the SDK's are the same, written out (no env in a runtime patch, no fieldRef in the SDK's env).
    command = manifest["spec"]["trainer"]["command"]
    assert command[command.index("--output-dir") + 1] == "/mnt/ddp/$(DDP_JOB_NAME)"
    assert "'argv': ['--output-dir', '/mnt/ddp/ddp-train', '--epochs', '3']" in sent["spec"]["trainer"]["command"][-1]
    env = {item["name"]: item.get("value") for item in sent["spec"]["trainer"]["env"]}
    assert env["DDP_JOB_ID"] == "trainjob/team-a/ddp-train" and env["DDP_JOB_NAME"] == "ddp-train"
    assert {item["name"] for item in manifest["spec"]["trainer"]["env"]} <= set(env)


def test_the_shipped_function_trains_under_torchrun_as_each_node_runs_it(tmp_path):
    """The script the SDK writes on each node (the function's source and its call), run under torchrun here:
    two ranks, the config file's text passed through, the trainer's exit code out."""
    from kubeflow.trainer.backends.container.utils import get_training_script_code

    config = "train:\n  epochs: 1\n"
    argv = [*SMALL[:-1], str(tmp_path / "run")]
    script = tmp_path / "trainjob.py"
    script.write_text(get_training_script_code(ddp_trainer(argv, config_yaml=config)))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world size 2" in done.stderr + done.stdout
    bad = script.read_text().replace("'--epochs'", "'--epoch-count'")
    script.write_text(bad)
    failed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                             str(script)], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert failed.returncode != 0 and "unrecognized arguments: --epoch-count" in failed.stderr


def test_bad_sdk_settings_are_one_line():
    with pytest.raises(ValueError, match=r"^num_nodes must be >= 1, got 0$"):
        ddp_trainer(num_nodes=0)
    with pytest.raises(ValueError, match=r"^gpus_per_node must be >= 0, got -1$"):
        ddp_trainer(gpus_per_node=-1)


# --- the SDK's container backend, on the Docker engine ----------------------------------------------------


class Jobs:
    """The SDK's client, and the jobs a test started: their containers and networks are removed afterwards."""

    def __init__(self, client) -> None:  # noqa: ANN001 - kubeflow.trainer.TrainerClient, imported late
        self.client = client
        self.started: list[str] = []

    def train(self, **trainer_settings) -> str:  # noqa: ANN003 - ddp_trainer's
        name = self.client.train(runtime="torch-distributed", trainer=ddp_trainer(image=IMAGE, **trainer_settings))
        self.started.append(name)
        return name


@pytest.fixture(scope="module")
def jobs() -> Iterator[Jobs]:
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False).returncode != 0:
        unavailable("no Docker engine answers")
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, timeout=30).returncode != 0:
        unavailable(f"the image {IMAGE} is not built (bash .ci/docker-setup.sh, or make image)")
    from kubeflow.trainer import ContainerBackendConfig, TrainerClient

    made = Jobs(TrainerClient(backend_config=ContainerBackendConfig(pull_policy="Never", container_runtime="docker")))
    yield made
    for name in made.started:
        made.client.delete_job(name)


@pytest.mark.slow
@pytest.mark.docker
def test_the_container_backend_trains_two_nodes_of_the_image_and_reports_a_bad_flag(jobs):
    client = jobs.client
    name = jobs.train(argv=SMALL, num_nodes=2)
    job = client.wait_for_job_status(name, status={"Complete"}, timeout=300, polling_interval=1)
    assert job.status == "Complete" and job.num_nodes == 2
    logs = "".join(client.get_job_logs(name))
    for rank in (0, 1):
        assert f"[rank {rank}/2] INFO rank {rank}/2 (local 0/1, node {rank}/2)" in logs and "via torchrun" in logs
    assert "final test accuracy" in logs and "world size 2" in logs

    bad = jobs.train(argv=[*SMALL, "--lr", "-1"], num_nodes=1)
    with pytest.raises(RuntimeError) as failed:
        client.wait_for_job_status(bad, status={"Complete"}, timeout=300, polling_interval=1)
    # torchrun exits 1 whatever its workers return (as under every torchrun launcher); the SDK's message shows the
    # tail of its summary, with the trainer's code, and the job's logs hold the trainer's one line.
    message = str(failed.value)
    assert "node-0: status=exited, exit_code=1" in message and re.search(r"exitcode\s*: 2 ", message), message
    assert "[rank 0] error: --lr must be > 0, got -1.0" in "".join(client.get_job_logs(bad))
