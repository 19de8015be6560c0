"""Checkpoints in an object store (k8s/components/object-store-checkpoints) and the pods' own cloud identity
(k8s/components/workload-identity-eks): a job that mounts no claim at all, whose every rank reads and writes the
checkpoints at one folder of its own in the store, with the store's credentials from an optional Secret or from the
job's ServiceAccount, on every kind of job and variant, renamed too (docs/kubernetes.md, "Storage")."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from adlfs import AzureBlobFileSystem

from tests.support.job_pods import the_job
from tests.support.k8s_manifests import K8S_DIR, KUSTOMIZATIONS, Obj, config_maps, of_kind, render, user_overlay
from tests.support.k8s_operator import PodPlan
from tests.support.k8s_operator import pod_plans as pytorchjob_pods
from tests.support.k8s_pods import pod_command
from tests.support.kubeflow_api import CHECKS, api_errors
from tests.support.pod_security import restricted_violations
from tests.support.trainer_v2 import pod_plans as trainjob_pods
from trainer.checkpoint import open_storage, storage
from trainer.cli import parse_config

COMPONENT, CREDENTIALS_COMPONENT = "object-store-checkpoints", "object-store-credentials"
STORE = "s3://BUCKET/ddp-deploy"  # the component's placeholder, then NAMESPACE/JOB
AZURE_STORE = "az://CONTAINER"  # what docs/kubernetes.md has a user write for s3://BUCKET on AKS
CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")
# Variants a user's overlay lists as its resources, the component in its components: every replica is still there.
OVER = ("k8s/base", "k8s/overlays/sharded", "k8s/overlays/tracking", "k8s/overlays/streamed-data",
        "k8s/overlays/gpu-multi-node", "k8s/trainer-v2", "k8s/overlays/trainjob-elastic")
# Variants that remove a replica in their own patches: the component goes into their own components list.
INSIDE = ("k8s/overlays/gpu-single-node", "k8s/overlays/elastic")


def inside(tmp_path: Path, source: str) -> list[Obj]:
    """The variant, in a copy of k8s/, with the component listed last among its own components."""
    shutil.copytree(K8S_DIR, tmp_path / "k8s", symlinks=True)
    path = tmp_path / source / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    kustomization.setdefault("components", []).extend(f"../../components/{name}"
                                                      for name in (COMPONENT, CREDENTIALS_COMPONENT))
    path.write_text(yaml.safe_dump(kustomization))
    return render(source, tmp_path)


# The operator's Worker init container as k8s/operator installs it (restricted-compliant, docs/kubernetes.md).
INIT_CONTAINER = (K8S_DIR / "components" / "restricted-init-container" / "initContainer.yaml").read_text()


def plans(job: Obj) -> list[PodPlan]:
    return pytorchjob_pods(job, INIT_CONTAINER) if job["kind"] == "PyTorchJob" else trainjob_pods(job)


def trainer_checkpoint_dir(objects: list[Obj], plan: PodPlan, tmp_path: Path) -> str:
    """Where the trainer in the pod puts its checkpoints: its command as the kubelet runs it, read by its parser."""
    command = pod_command(plan)
    mounted = {mount["mountPath"]: mount["name"] for mount in plan.container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in plan.template["spec"]["volumes"]}
    config_path = Path(command[command.index("--config") + 1])
    config_map = config_maps(objects)[volumes[mounted[str(config_path.parent)]]["configMap"]["name"]]
    (tmp_path / "config.yaml").write_text(config_map[config_path.name])
    return parse_config(["--config", str(tmp_path / "config.yaml"),
                         *command[command.index("--config") + 2:]])[0].checkpoint_location


def assert_checkpoints_in_the_store(objects: list[Obj], tmp_path: Path) -> None:
    job = the_job(objects)
    for plan in plans(job):
        spec = plan.template["spec"]
        assert not [v for v in spec["volumes"] if "persistentVolumeClaim" in v], f"{plan.name}: no claim to bind"
        assert trainer_checkpoint_dir(objects, plan, tmp_path) == \
            f"{STORE}/{plan.namespace}/{job['metadata']['name']}", plan.name
        # /mnt/ddp, where the metrics go, is the pod's own now.
        (storage,) = [v for v in spec["volumes"] if v["name"] == "storage"]
        assert "emptyDir" in storage and "sizeLimit" in storage["emptyDir"], plan.name
        names = [entry["name"] for entry in plan.container["env"]]
        # A container's env is a list keyed by name in both CRDs: the API server refuses a name given twice.
        assert len(names) == len(set(names)), (plan.name, names)
        env = [entry for entry in plan.container["env"] if entry["name"] in CREDENTIALS]
        assert {entry["name"] for entry in env} == set(CREDENTIALS), plan.name
        for entry in env:  # optional: the pods start without the Secret, on their own identity
            assert entry["valueFrom"] == {"secretKeyRef": {"name": "data-credentials", "key": entry["name"],
                                                           "optional": True}}, plan.name
        assert restricted_violations(spec) == [], plan.name
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CHECKS:
            assert api_errors(obj) == [], obj["kind"]


@pytest.mark.parametrize("source", OVER)
def test_a_job_over_the_component_keeps_its_checkpoints_in_its_own_folder_of_the_store(source, tmp_path):
    # streamed-data sets the credentials itself, from the same Secret.
    components = [COMPONENT] if "streamed-data" in source else [COMPONENT, CREDENTIALS_COMPONENT]
    assert_checkpoints_in_the_store(user_overlay(tmp_path, source, components), tmp_path)


@pytest.mark.parametrize("source", INSIDE)
def test_a_variant_with_one_replica_lists_the_component_among_its_own(source, tmp_path):
    assert_checkpoints_in_the_store(inside(tmp_path, source), tmp_path)


def test_two_renamed_jobs_in_one_namespace_get_two_folders(tmp_path):
    plain = user_overlay(tmp_path, "k8s/base", [COMPONENT])
    first = {trainer_checkpoint_dir(plain, plan, tmp_path) for plan in plans(the_job(plain))}
    shutil.rmtree(tmp_path / "overlay")
    renamed = user_overlay(tmp_path, "k8s/base", [COMPONENT], prefix="team-a-")
    second = {trainer_checkpoint_dir(renamed, plan, tmp_path) for plan in plans(the_job(renamed))}
    assert first == {f"{STORE}/default/ddp-train"} and second == {f"{STORE}/default/team-a-ddp-train"}


def test_without_the_component_the_job_checkpoints_on_the_shared_claim(tmp_path):
    objects = render("k8s/base")
    for plan in plans(the_job(objects)):
        assert trainer_checkpoint_dir(objects, plan, tmp_path) == "/mnt/ddp/ddp-train/checkpoints"


@pytest.mark.parametrize("prefix", ["", "team-a-"])
def test_the_eks_identity_annotates_the_account_every_pod_runs_as(prefix, tmp_path):
    objects = user_overlay(tmp_path, "k8s/base", [COMPONENT, "workload-identity-eks"], prefix)
    (account,) = of_kind(objects, "ServiceAccount")
    assert account["metadata"]["name"] == f"{prefix}ddp-train"
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    assert account["automountServiceAccountToken"] is False, "IRSA's token is a volume of its own"
    for plan in plans(the_job(objects)):
        assert plan.template["spec"]["serviceAccountName"] == account["metadata"]["name"], plan.name


def test_the_store_alone_names_no_credentials_so_the_pods_own_identity_serves(tmp_path):
    for plan in plans(the_job(user_overlay(tmp_path, "k8s/base", [COMPONENT]))):
        assert not [entry for entry in plan.container["env"] if entry["name"] in CREDENTIALS], plan.name


@pytest.mark.parametrize("source", [*KUSTOMIZATIONS, "k8s"])
def test_no_container_of_any_job_names_a_variable_twice(source):
    for plan in plans(the_job(render(source))):
        names = [entry["name"] for entry in plan.container.get("env", [])]
        assert len(names) == len(set(names)), (plan.name, names)


def with_azure_store(tmp_path: Path) -> None:
    """A copy of k8s/ whose object-store-checkpoints names an Azure container: the one value docs/kubernetes.md has
    a user change for AKS."""
    shutil.copytree(K8S_DIR, tmp_path / "k8s", symlinks=True)
    for patch in (tmp_path / "k8s" / "components" / COMPONENT).glob("*-patch.yaml"):
        patch.write_text(patch.read_text().replace("s3://BUCKET/", f"{AZURE_STORE}/"))



@pytest.mark.parametrize("source", ["k8s/base", "k8s/trainer-v2"])
@pytest.mark.parametrize("prefix", ["", "team-a-"])
def test_the_aks_identity_labels_every_pod_for_the_webhook_and_names_the_storage_account(source, prefix, tmp_path):
    objects = user_overlay(tmp_path, source, [COMPONENT, "workload-identity-aks"], prefix)
    (account,) = of_kind(objects, "ServiceAccount")
    assert account["metadata"]["name"] == f"{prefix}ddp-train"
    assert "azure.workload.identity/client-id" in account["metadata"]["annotations"]
    assert account["automountServiceAccountToken"] is False, "the webhook's token is a volume of its own"
    for plan in plans(the_job(objects)):
        spec = plan.template["spec"]
        assert spec["serviceAccountName"] == account["metadata"]["name"], plan.name
        # The webhook mutates labelled pods only: the account's annotation alone gives a pod no token.
        assert plan.template["metadata"]["labels"]["azure.workload.identity/use"] == "true", plan.name
        assert {"name": "AZURE_STORAGE_ACCOUNT_NAME", "value": "ACCOUNT"} in plan.container["env"], plan.name
        names = [entry["name"] for entry in plan.container["env"]]
        assert len(names) == len(set(names)), (plan.name, names)
        assert restricted_violations(spec) == [], plan.name
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CHECKS:
            assert api_errors(obj) == [], obj["kind"]


@pytest.mark.parametrize("source", ["k8s/base", "k8s/trainer-v2"])
def test_an_azure_container_in_the_component_is_the_trainers_adlfs_folder_in_the_named_account(
        source, tmp_path, monkeypatch):
    with_azure_store(tmp_path)
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [f"../{source}"],
        "components": [f"../k8s/components/{name}" for name in (COMPONENT, "workload-identity-aks")]}))
    objects = render(folder.name, tmp_path)
    job = the_job(objects)
    for plan in plans(job):
        location = trainer_checkpoint_dir(objects, plan, tmp_path)
        assert location == f"{AZURE_STORE}/ddp-deploy/{plan.namespace}/{job['metadata']['name']}", plan.name
        env = {entry["name"]: entry.get("value") for entry in plan.container["env"]}
        monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", env["AZURE_STORAGE_ACCOUNT_NAME"])
        # adlfs as the pod opens it (no key, no connection string: the webhook's identity), without a request yet,
        # and not one that fsspec kept from an earlier open of the same URL.
        monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
        AzureBlobFileSystem.clear_instance_cache()
        try:
            store = open_storage(location)
            assert isinstance(store, storage.FsspecStorage) and type(store.fs).__module__.startswith("adlfs"), plan.name
            assert store.fs.account_name == "ACCOUNT" and store.fs.connection_string is None, plan.name
        finally:  # never left for a later test to reuse: it has no credentials but the cloud's identity
            AzureBlobFileSystem.clear_instance_cache()
        assert store.root == f"CONTAINER/ddp-deploy/{plan.namespace}/{job['metadata']['name']}", plan.name
