"""The trainer as a Kubeflow Trainer job submitted from Python: ``TrainerClient().train(...)`` (PyPI ``kubeflow``).

``ddp_trainer(...)`` is the TrainJob of ``k8s/trainer-v2`` as the SDK's ``CustomTrainer``: the same image, nodes,
processes per node, resources, environment and config, under the same ``torch-distributed`` runtime. The SDK
ships the source of ``ddp_train`` (below) to every node and starts it under torchrun, which hands it its rank;
the function writes the config and calls ``trainer.run``, so every flag, task and exit code is the trainer's.

    from kubeflow.trainer import TrainerClient
    from kubeflow_sdk.trainjob import cluster_job

    client = TrainerClient()                                   # Kubernetes: the cluster of your kubeconfig
    job = client.train(runtime="torch-distributed", **cluster_job("ddp-train", ["--epochs", "3"], num_nodes=2))
    client.wait_for_job_status(job)

``cluster_job`` adds to ``ddp_trainer``'s what else of k8s/trainer-v2's TrainJob the SDK lets a caller set: the
label, the deadline, the runtime patch (the pods' ServiceAccount, hardening, do-not-disrupt annotations, the
shared claim), the run folder and the job's name for the lease. What it cannot set (the ServiceAccount and
PodDisruptionBudget objects, the grace period) is in docs/kubernetes.md, "From Python: Kubeflow Trainer's SDK".

The same job runs on one machine with the SDK's container backend (Docker or Podman), a container per node
on a network of its own: ``TrainerClient(backend_config=ContainerBackendConfig())``. Its local-process backend
is not for this trainer: it builds a fresh virtual environment per job and pip-installs torch into it, and runs
one process on one node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DEFAULT_IMAGE", "cluster_job", "ddp_train", "ddp_trainer"]

DEFAULT_IMAGE = "ddp-deploy"  # k8s/trainer-v2's placeholder; `make k8s-image` and --image name the real one


def ddp_train(argv: list[str], config_yaml: str = "", task: str = "") -> None:
    """What each node runs under torchrun. Self-contained on purpose: the SDK ships this function's source,
    not its module, so it imports what it needs itself."""
    import sys
    import tempfile
    from pathlib import Path

    import trainer

    if config_yaml:  # a ConfigMap's file, as k8s/trainer-v2 mounts it at /etc/ddp/config.yaml
        config = Path(tempfile.mkdtemp(prefix="ddp-config-")) / "config.yaml"
        config.write_text(config_yaml)
        argv = ["--config", str(config), *argv]
    code = trainer.run(task or None, argv=argv)
    if code:
        sys.exit(code)  # torchrun, the container and the SDK's job status see the trainer's exit code


def ddp_trainer(argv: Sequence[str] = (), *, config_yaml: str = "", task: str = "", image: str = DEFAULT_IMAGE,
                num_nodes: int = 2, gpus_per_node: int = 0, cpu: str | int = "2", memory: str = "4Gi",
                env: Mapping[str, str] | None = None) -> Any:
    """The SDK's CustomTrainer for ``trainer.run(task, argv)`` on ``num_nodes`` nodes (one process per node, or
    one per GPU). ``task``: a built-in's name or ``package.module:Class`` inside the image (empty: --task or the
    built-in); ``config_yaml``: a config file's text (k8s/base/configmap.yaml's); ``env`` adds variables, and is
    where credentials go (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN), never ``argv``."""
    from kubeflow.trainer import CustomTrainer  # imported late: an extra (pip install 'ddp-deploy[kubeflow]')

    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    if gpus_per_node < 0:
        raise ValueError(f"gpus_per_node must be >= 0, got {gpus_per_node}")
    resources: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus_per_node:
        resources["gpu"] = gpus_per_node  # the SDK starts one process per GPU
    # HOME: the image's user has no home folder and Kubernetes' root file system is read-only (k8s/trainer-v2).
    variables = {"HOME": "/tmp", "OMP_NUM_THREADS": str(cpu), **(env or {})}
    return CustomTrainer(func=ddp_train, func_args={"argv": list(argv), "config_yaml": config_yaml, "task": task},
                         image=image, num_nodes=num_nodes, resources_per_node=resources, env=variables)


# k8s/trainer-v2/trainjob.yaml's, where the SDK has a field for them (tests/deploy/test_kubeflow_sdk.py compares).
LABELS = {"app.kubernetes.io/name": "ddp-deploy"}
POD_ANNOTATIONS = {
    "sidecar.istio.io/inject": "false",
    # No scale-down or consolidation of the node under a running job: one lost pod stops every rank.
    "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
    "karpenter.sh/do-not-disrupt": "true",
}
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}}


def cluster_job(name: str, argv: Sequence[str] = (), *, namespace: str = "default", deadline_s: int = 86400,
                service_account: str = "ddp-train", claim: str = "ddp-deploy-storage",
                **trainer_settings: Any) -> dict[str, Any]:
    """``TrainerClient().train(runtime="torch-distributed", **cluster_job(NAME, argv, ...))`` on Kubernetes: the job
    named NAME in ``namespace`` (the client's), made the TrainJob of k8s/trainer-v2 as far as the SDK allows. Its
    label and deadline; its runtime patch: the pods' ServiceAccount, hardening, do-not-disrupt annotations and the
    shared claim; its run folder /mnt/ddp/NAME and its name for the lease. ``service_account`` and ``claim``:
    k8s/base's ServiceAccount and k8s/storage's claim, which must exist (the SDK makes no object but the TrainJob).
    ``trainer_settings``: ddp_trainer's."""
    from kubeflow.trainer import options as sdk

    # The name is given, not read from the pod as the manifest's fieldRef does: Trainer's webhook refuses env in a
    # runtime patch, and the SDK's trainer env holds plain values only.
    job_env = {"DDP_JOB_NAMESPACE": namespace, "DDP_JOB_NAME": name, "DDP_JOB_ID": f"trainjob/{namespace}/{name}"}
    env = {**job_env, **(trainer_settings.pop("env", None) or {})}
    # First, so that an --output-dir of argv's wins.
    trainer = ddp_trainer(["--output-dir", f"/mnt/ddp/{name}", *argv], env=env, **trainer_settings)
    volumes = [{"name": "storage", "persistentVolumeClaim": {"claimName": claim}},
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
               {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
               # The SDK writes the function's file into the working folder, on a read-only root file system.
               {"name": "workspace", "emptyDir": {"sizeLimit": "64Mi"}}]
    mounts = [{"name": "storage", "mountPath": "/mnt/ddp"}, {"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "tmp", "mountPath": "/tmp"}, {"name": "workspace", "mountPath": "/workspace"}]
    node = sdk.ContainerPatch(name="node", volume_mounts=mounts, security_context=CONTAINER_SECURITY)
    pod_spec = sdk.PodSpecPatch(service_account_name=service_account, security_context=POD_SECURITY,
                                containers=[node], volumes=volumes)
    pod = sdk.PodTemplatePatch(metadata={"annotations": POD_ANNOTATIONS}, spec=pod_spec)
    nodes = sdk.ReplicatedJobPatch(name="node", template=sdk.JobTemplatePatch(spec=sdk.JobSpecPatch(template=pod)))
    patch = sdk.RuntimePatch(training_runtime_spec=sdk.TrainingRuntimeSpecPatch(
        template=sdk.JobSetTemplatePatch(spec=sdk.JobSetSpecPatch(replicated_jobs=[nodes]))))
    options = [sdk.Name(name=name), sdk.Labels(labels=LABELS), sdk.ActiveDeadlineSeconds(seconds=deadline_s), patch]
    return {"trainer": trainer, "options": options}
