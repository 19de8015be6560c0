"""The Kubernetes manifests: what kubectl applies, checked against the real APIs and the operator's rules.

Every source is rendered as the cluster would receive it: `kubectl apply -f k8s/`, and `kubectl apply -k`
on the base, each overlay and the Trainer v2 variant.
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
import urllib.parse
from pathlib import Path

import kubernetes_validate
import pytest

from devtools.processes import REPO_ROOT
from tests.support.k8s_manifests import (
    K8S_DIR,
    PLAIN_DIR,
    SHARED_CLAIM,
    SOURCES,
    STORAGE_SOURCES,
    TRAINJOB_SOURCES,
    Obj,
    config_maps,
    copy_for_make,
    images,
    make_k8s_image,
    of_kind,
    render,
)
from tests.support.k8s_operator import CONTAINER, PodPlan, admission_errors, pod_plans
from tests.support.k8s_pods import pod_command
from tests.support.kubeflow_api import CHECKS, api_errors
from tests.support.trainer_v2 import admission_errors as trainjob_admission_errors
from tests.support.trainer_v2 import pod_plans as trainer_v2_pods
from trainer.cli import layout, parse_config
from trainer.config import Config
from trainer.launchers import ELASTIC_AGENT_ENV
from trainer.task import RunTask

# The oldest Kubernetes the training operator v1.9 supports, and the newest schema known offline.
KUBERNETES_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
PYTORCHJOB_SOURCES = tuple(source for source in SOURCES if source not in TRAINJOB_SOURCES)
# torchrun's agent kills its workers this long after forwarding SIGTERM to them.
TORCHRUN_SHUTDOWN_S = 30


def job_of(source: str) -> Obj:
    (job,) = of_kind(render(source), "PyTorchJob")
    return job


def trainer_config(source: str, plan: PodPlan, tmp_path: Path) -> tuple[Config, RunTask]:
    """The trainer's config and task as the pod's command would read them from the mounted ConfigMap: the flags
    from --config on, in the command (a TrainJob's) or its args (a PyTorchJob's)."""
    args = pod_command(plan)  # as the kubelet runs it: $(DDP_JOB_NAME) and the like filled in
    mount_path = Path(args[args.index("--config") + 1])
    volumes = {v["name"]: v for v in plan.template["spec"]["volumes"]}
    for mount in plan.container["volumeMounts"]:
        if mount_path.is_relative_to(mount["mountPath"]):
            config_map = config_maps(render(source))[volumes[mount["name"]]["configMap"]["name"]]
            text = config_map[str(mount_path.relative_to(mount["mountPath"]))]
            break
    else:
        raise AssertionError(f"--config {mount_path} is on no volume of pod {plan.name}")
    (tmp_path / "config.yaml").write_text(text)
    return parse_config(["--config", str(tmp_path / "config.yaml"), *args[args.index("--config") + 2:]])


def test_kubectl_apply_on_the_folder_sends_the_job_its_config_and_its_volume():
    objects = render(PLAIN_DIR)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == [
        ("ConfigMap", "ddp-train-config"), ("NetworkPolicy", "ddp-train"), ("PodDisruptionBudget", "ddp-train"),
        ("PyTorchJob", "ddp-train"), ("ServiceAccount", "ddp-train")]
    applied = [p for p in K8S_DIR.iterdir() if p.suffix in (".yaml", ".yml", ".json")]
    assert len(applied) == len(objects), "each file directly in k8s/ holds one object"


@pytest.mark.parametrize("source", STORAGE_SOURCES)
def test_the_shared_claim_is_applied_apart_from_every_job(source):
    """`kubectl delete -f k8s/` (or -k of a variant) deletes the job and keeps its checkpoints: the claim is
    k8s/storage's alone, and no job's set holds it but the kind overlay's (a laptop's throwaway cluster)."""
    assert [(o["kind"], o["metadata"]["name"]) for o in render(source)] == [("PersistentVolumeClaim", SHARED_CLAIM)]
    for job_source in SOURCES:
        claims = {o["metadata"]["name"] for o in of_kind(render(job_source), "PersistentVolumeClaim")}
        assert (SHARED_CLAIM in claims) == (job_source == "k8s/overlays/kind"), job_source


def test_the_folder_and_the_kustomize_base_apply_the_same_objects():
    def key(obj: Obj) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]
    assert sorted(render(PLAIN_DIR), key=key) == sorted(render("k8s/base"), key=key)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("source", (*SOURCES, *STORAGE_SOURCES))
def test_every_object_passes_its_schema_strictly(source, version):
    for obj in render(source):
        if (obj["apiVersion"], obj["kind"]) in CHECKS:
            assert api_errors(obj) == [], f"{obj['kind']} {obj['metadata']['name']}"
        else:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize(("kind", "source", "path", "change", "error"), [
    ("PyTorchJob", "k8s", ("spec",), {"nprocPerNod": "1"}, "spec.nprocPerNod: not a field"),
    ("PyTorchJob", "k8s", ("spec", "runPolicy"), {"backoffLimit": "3"}, "backoffLimit: '3' has the wrong type"),
    ("PyTorchJob", "k8s", ("metadata",), {"lables": {}}, "metadata.lables: not a field"),
    ("TrainJob", "k8s/trainer-v2", ("spec", "trainer"), {"numNode": 2}, "spec.trainer.numNode: not a field"),
    ("TrainJob", "k8s/trainer-v2", ("spec", "trainer"), {"numNodes": "2"}, "numNodes"),
])
def test_a_misspelled_or_mistyped_field_of_a_kubeflow_object_is_an_error(kind, source, path, change, error):
    (obj,) = of_kind(render(source), kind)
    target = obj
    for key in path:
        target = target[key]
    target.update(change)
    assert any(error in problem for problem in api_errors(obj)), api_errors(obj)


@pytest.mark.parametrize("rtype", ["Master", "Worker"])
def test_a_second_env_entry_of_one_name_in_a_pytorchjob_container_is_refused(rtype):
    """The PyTorchJob's CRD makes each container's env a list map keyed by name; the API server refuses the job."""
    job = job_of("k8s")
    (container,) = job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]["containers"]
    env = container.setdefault("env", [])
    env += [{"name": "AWS_ACCESS_KEY_ID", "value": "a"}, {"name": "AWS_ACCESS_KEY_ID", "value": "b"}]
    assert api_errors(job) == [f"spec.pytorchReplicaSpecs.{rtype}.template.spec.containers.0.env.{len(env) - 1}: "
                               f'Duplicate value: {{"name": "AWS_ACCESS_KEY_ID"}} (item {len(env) - 2} has it)']


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_pod_templates_pass_the_kubernetes_pod_schema_strictly(source, version):
    # The CRD schema stops at the pod template's outline; Kubernetes' own schema checks every field.
    for rtype, replica in job_of(source)["spec"]["pytorchReplicaSpecs"].items():
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": rtype.lower()},
                        "template": replica["template"]}
        kubernetes_validate.validate(pod_template, version, strict=True)


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_training_operator_admits_the_job(source):
    assert admission_errors(job_of(source)) == []


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_each_pod_runs_a_fixed_number_of_processes_one_per_gpu(source):
    job = job_of(source)
    nproc = job["spec"]["nprocPerNode"]
    assert nproc.isdigit(), f"nprocPerNode {nproc!r}: 'auto' starts one process per host CPU on CPU pods"
    for plan in pod_plans(job):
        gpus = plan.container["resources"]["limits"].get("nvidia.com/gpu")
        assert int(nproc) == (int(gpus) if gpus else 1), plan.name


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_restart_policy_matches_what_the_command_exits_with(source):
    job = job_of(source)
    for rtype, replica in job["spec"]["pytorchReplicaSpecs"].items():
        (container,) = [c for c in replica["template"]["spec"]["containers"] if c["name"] == CONTAINER]
        if container["command"] in (["ddp-train"], ["python", "-m", "forecast.train"]):  # trainer.run
            # The trainer's own codes: 143 after a preemption checkpoint is retried, bad input is not.
            assert replica["restartPolicy"] == "ExitCode", rtype
            assert job["spec"]["nprocPerNode"] == "1", "the trainer started directly runs one process per pod"
        else:
            # torchrun exits 1 after SIGTERM, whatever its workers did: ExitCode would never retry it.
            assert container["command"] == ["torchrun"] and replica["restartPolicy"] == "OnFailure", rtype


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_torchruns_agent_outlives_the_preemption_checkpoint(source, tmp_path):
    # The pod's own grace period against the trainer's: tests/deploy/test_k8s_spot.py, for every pod of every job.
    for plan in pod_plans(job_of(source)):
        grace_s = trainer_config(source, plan, tmp_path)[0].checkpoint.grace_period_s
        if plan.container["command"] == ["torchrun"]:
            assert grace_s < TORCHRUN_SHUTDOWN_S, plan.name


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_checkpoints_are_on_the_persistent_volume_so_new_pods_resume(source, tmp_path):
    for plan in pod_plans(job_of(source)):
        config, _ = trainer_config(source, plan, tmp_path)
        assert config.checkpoint.resume == "latest"
        volumes = {v["name"]: v for v in plan.template["spec"]["volumes"]}
        claim_paths = [m["mountPath"] for m in plan.container["volumeMounts"]
                       if "persistentVolumeClaim" in volumes[m["name"]] and not m.get("readOnly")]
        assert any(Path(config.checkpoint_location).is_relative_to(p) for p in claim_paths), plan.name
        assert any(Path(config.output.output_dir).is_relative_to(p) for p in claim_paths), plan.name
        # The job's own folder on the claim the namespace's jobs share: its name, as the operator labels its pods.
        assert config.output.output_dir == f"/mnt/ddp/{job_of(source)['metadata']['name']}", plan.name
        assert {volumes[m["name"]]["persistentVolumeClaim"]["claimName"] for m in plan.container["volumeMounts"]
                if "persistentVolumeClaim" in volumes[m["name"]]} == {SHARED_CLAIM}, plan.name


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_shared_memory_is_memory_backed(source):
    for plan in pod_plans(job_of(source)):
        volumes = {v["name"]: v for v in plan.template["spec"]["volumes"]}
        (shm,) = [m for m in plan.container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory", plan.name


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_containers_request_and_limit_cpu_and_memory(source):
    for plan in pod_plans(job_of(source)):
        resources = plan.container["resources"]
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources[bound]), f"{plan.name}: {bound}"


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_pods_run_as_a_user_without_privileges(source):
    for plan in pod_plans(job_of(source)):
        pod = plan.template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), plan.name
        assert pod["automountServiceAccountToken"] is False, f"{plan.name}: no API token in a training pod"
        assert not any("hostPath" in v for v in pod["volumes"]), plan.name
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False and not security.get("privileged")
            assert security["capabilities"]["drop"] == ["ALL"] and "add" not in security["capabilities"]
            assert security["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_run_policy_bounds_retries_and_cleans_up(source):
    run_policy = job_of(source)["spec"]["runPolicy"]
    assert run_policy["backoffLimit"] >= 1
    assert run_policy["cleanPodPolicy"] in ("Running", "All")
    assert run_policy["ttlSecondsAfterFinished"] > 0


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_only_the_jobs_own_pods_may_connect_to_its_pods(source):
    objects = render(source)
    (job,) = of_kind(objects, "PyTorchJob")
    (policy,) = of_kind(objects, "NetworkPolicy")
    # The label the training operator puts on each pod it creates for this job.
    own_pods = {"matchLabels": {"training.kubeflow.org/job-name": job["metadata"]["name"]}}
    spec = policy["spec"]
    assert spec["podSelector"] == own_pods and spec["policyTypes"] == ["Ingress"]
    assert spec["ingress"] == [{"from": [{"podSelector": own_pods}]}], "no other source, no namespace, no address"
    assert policy["metadata"].get("namespace") == job["metadata"].get("namespace")


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_pods_opt_out_of_sidecar_injection(source):
    for plan in pod_plans(job_of(source)):
        assert plan.template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false", plan.name


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_config_map_is_a_valid_trainer_config(source, tmp_path):
    for plan in pod_plans(job_of(source)):
        trainer_config(source, plan, tmp_path)


@pytest.mark.parametrize("source", ["k8s/overlays/gpu-single-node", "k8s/overlays/gpu-multi-node"])
def test_gpu_jobs_train_the_cpu_job_on_cuda_with_nccl(source, tmp_path):
    (gpu_plan, *_), (cpu_plan, *_) = pod_plans(job_of(source)), pod_plans(job_of(PLAIN_DIR))
    gpu = layout(*trainer_config(source, gpu_plan, tmp_path))
    cpu = layout(*trainer_config(PLAIN_DIR, cpu_plan, tmp_path))
    assert (gpu["dist"]["device"], gpu["dist"]["backend"]) == ("cuda", "nccl")
    assert {k: v for k, v in gpu.items() if k != "dist"} == {k: v for k, v in cpu.items() if k != "dist"}


def test_the_tracking_overlay_sends_rank_0_to_an_mlflow_server_that_accepts_its_host_name(tmp_path):
    source = "k8s/overlays/tracking"
    objects = render(source)
    plans = pod_plans(job_of(source))
    configs = [layout(*trainer_config(source, plan, tmp_path)) for plan in plans]
    assert {config["tracking"]["tracker"] for config in configs} == {"mlflow"}, "every rank, one config"
    base = layout(*trainer_config("k8s/base", pod_plans(job_of("k8s/base"))[0], tmp_path))
    def untracked(config: dict) -> dict:
        return {section: values for section, values in config.items() if section != "tracking"}
    assert untracked(configs[0]) == untracked(base), "the base job, tracked"
    env = {item["name"]: item for item in plans[0].container["env"]}
    uri = urllib.parse.urlsplit(env["MLFLOW_TRACKING_URI"]["value"])
    (service,) = of_kind(objects, "Service")
    assert (uri.hostname, uri.port) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
    # Credentials come from a Secret, never from the config or the command line; optional, for a server without.
    for name, key in (("MLFLOW_TRACKING_USERNAME", "username"), ("MLFLOW_TRACKING_PASSWORD", "password")):
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "mlflow-credentials", "key": key, "optional": True}
    (server,) = of_kind(objects, "Deployment")
    (container,) = server["spec"]["template"]["spec"]["containers"]
    allowed = next(arg for arg in container["args"] if arg.startswith("--allowed-hosts="))
    assert uri.netloc in allowed.split("=", 1)[1].split(","), "MLflow answers 403 to a Host it does not allow"
    assert server["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert server["spec"]["replicas"] == 1 and server["spec"]["strategy"]["type"] == "Recreate", "one SQLite writer"


# The PyTorchJob and the TrainJob with their data in an object store, and the job each one changes.
STREAMED_DATA = {"k8s/overlays/streamed-data": "k8s/base", "k8s/overlays/trainjob-streamed-data": "k8s/trainer-v2"}
DATA_SETTINGS = {"dataset", "data_dir", "shard_cache_dir", "shard_cache_gb"}
AWS_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")


def plans_of(source: str) -> list[PodPlan]:
    """Every pod of the source's job, a PyTorchJob's or a TrainJob's, with what its operator gives it."""
    if source in TRAINJOB_SOURCES:
        (trainjob,) = of_kind(render(source), "TrainJob")
        return trainer_v2_pods(trainjob)
    return pod_plans(job_of(source))


@pytest.mark.parametrize(("source", "base"), STREAMED_DATA.items())
def test_the_streamed_data_overlays_read_shards_from_the_store_with_optional_credentials_and_a_bounded_cache(
        source, base, tmp_path):
    plans = plans_of(source)
    # Each pod's command, parsed as ddp-train parses it with the mounted config: shards from an s3:// prefix.
    configs = [layout(*trainer_config(source, plan, tmp_path)) for plan in plans]
    settings = {(config["task"]["dataset"], config["task"]["data_dir"], config["data"]["shard_cache_dir"],
                 config["data"]["shard_cache_gb"]) for config in configs}
    ((dataset, url, cache_dir, cache_gb),) = settings  # one for every pod
    assert dataset == "shards" and url.startswith("s3://")
    plain = layout(*trainer_config(base, plans_of(base)[0], tmp_path))

    def other_settings(config: dict) -> dict:
        return {section: {name: value for name, value in values.items() if name not in DATA_SETTINGS}
                for section, values in config.items()}
    assert other_settings(configs[0]) == other_settings(plain), "the job it changes, its data streamed"
    for plan in plans:
        env = {item["name"]: item for item in plan.container["env"]}
        # From a Secret, never the config or the command line; optional: pods with access of their own (IRSA,
        # Workload Identity) and stores without an endpoint or region of their own need no Secret or key.
        for name in AWS_VARIABLES:
            assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "data-credentials", "key": name,
                                                              "optional": True}, plan.name
        volumes = {volume["name"]: volume for volume in plan.template["spec"]["volumes"]}
        (mount,) = [mount for mount in plan.container["volumeMounts"] if mount["mountPath"] == cache_dir]
        cache = volumes[mount["name"]]["emptyDir"]
        assert "medium" not in cache, "the cache is on the node's disk, not in the pod's memory"
        size = int(cache["sizeLimit"].removesuffix("Gi")) * 2**30
        assert 1.1 * cache_gb * 1e9 <= size <= 1.5 * cache_gb * 1e9, "--shard-cache-gb and some headroom"
        assert plan.container["resources"]["requests"]["ephemeral-storage"] == cache["sizeLimit"], "scheduled to fit"


def test_elastic_job_joins_a_c10d_rendezvous_that_closes_when_all_workers_are_in():
    job = job_of("k8s/overlays/elastic")
    spec = job["spec"]
    elastic, workers = spec["elasticPolicy"], spec["pytorchReplicaSpecs"]["Worker"]["replicas"]
    # torchrun's run id: the job's name for its checkpoint folder's lease in every round (Torchrun.job).
    assert elastic["rdzvId"] == job["metadata"]["name"]
    assert "Master" not in spec["pytorchReplicaSpecs"]
    assert elastic["rdzvBackend"] == "c10d" and elastic["maxRestarts"] >= 1
    assert elastic["minReplicas"] < workers == elastic["maxReplicas"]
    for plan in pod_plans(job):  # every agent: a node that joins completes the round (ELASTIC_AGENT_ENV)
        env = {item["name"]: item.get("value") for item in plan.container.get("env", [])}
        assert all(env.get(name) == value for name, value in ELASTIC_AGENT_ENV.items()), (plan.name, env)


def test_kind_job_uses_the_loaded_image_and_volumes_kind_can_provide():
    objects = render("k8s/overlays/kind")
    (claim,) = of_kind(objects, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    for plan in pod_plans(job_of("k8s/overlays/kind")):
        assert plan.container["imagePullPolicy"] == "Never", plan.name


def test_multi_node_jobs_share_one_volume_across_nodes():
    for source in STORAGE_SOURCES:
        (claim,) = of_kind(render(source), "PersistentVolumeClaim")
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"], source


@pytest.mark.parametrize("source", TRAINJOB_SOURCES)
def test_trainjob_runs_torchrun_in_the_torch_runtime(source):
    (trainjob,) = of_kind(render(source), "TrainJob")
    trainer = trainjob["spec"]["trainer"]
    assert trainjob["spec"]["runtimeRef"]["name"] == "torch-distributed"
    # Trainer v2 sets only PET_* variables: without torchrun the trainer would not know its rank.
    assert trainer["command"][0] in ("torchrun", "ddp-torchrun")
    assert trainjob_admission_errors(trainjob) == []  # no variable of those Trainer v2 sets itself


def test_the_elastic_trainjob_sets_its_node_bounds_where_trainer_v2_lets_it():
    """Setting PET_NNODES=1:2 in the trainer's env, as for torchrun alone, is refused by Trainer v2's webhook; the
    overlay gives the bounds on torchrun's command line instead, which wins over the PET_NNODES the plugin sets."""
    (trainjob,) = of_kind(render("k8s/overlays/trainjob-elastic"), "TrainJob")
    as_env = copy.deepcopy(trainjob)
    as_env["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "1:2"})
    assert trainjob_admission_errors(as_env) == [
        "spec.trainer.env: must not have reserved envs, invalid envs configured: ['PET_NNODES']"]
    plans = trainer_v2_pods(trainjob)
    commands = [pod_command(plan) for plan in plans]
    assert all("--nnodes=1:2" in command and "--rdzv-endpoint=ddp-train-node-0-0.ddp-train:29500" in command
               for command in commands), commands
    assert len(plans) == trainjob["spec"]["trainer"]["numNodes"] == 2



# --- the image: named in one place (k8s/components/image), changed without editing YAML ---------------------

IMAGE_SCRIPT = REPO_ROOT / "scripts" / "k8s_image.py"


def test_the_folder_copy_of_the_job_is_in_line_with_the_base_and_the_image_component():
    checked = subprocess.run([sys.executable, str(IMAGE_SCRIPT), "--check"], capture_output=True, text=True,
                             timeout=60, check=False)
    assert checked.returncode == 0, checked.stderr


@pytest.fixture
def k8s_copy(tmp_path: Path) -> Path:
    return copy_for_make(tmp_path)


def test_make_k8s_image_points_every_manifest_and_overlay_at_the_registry(k8s_copy):
    cpu = "registry.example.com:5000/team/ddp-deploy:sha-0123456789ab"
    cuda = "registry.example.com/ddp-deploy@sha256:" + "a" * 64
    before = {path: path.read_text() for path in (k8s_copy / "k8s").rglob("*.yaml") if not path.is_symlink()}
    made = make_k8s_image(k8s_copy, f"IMAGE={cpu}", f"CUDA_IMAGE={cuda}")
    assert made.returncode == 0, made.stdout + made.stderr
    assert f"the manifests run {cpu} (GPU overlays: {cuda})" in made.stdout
    changed = {path.relative_to(k8s_copy).as_posix() for path, text in before.items() if path.read_text() != text}
    assert changed == {"k8s/components/image/kustomization.yaml", "k8s/pytorchjob.yaml"}
    expected = {PLAIN_DIR: {cpu}, "k8s/base": {cpu}, "k8s/overlays/elastic": {cpu}, "k8s/trainer-v2": {cpu},
                "k8s/overlays/trainjob-elastic": {cpu}, "k8s/overlays/sharded": {cpu}, "k8s/overlays/tracking": {cpu},
                "k8s/overlays/streamed-data": {cpu}, "k8s/overlays/trainjob-streamed-data": {cpu},
                "k8s/overlays/gpu-single-node": {cuda}, "k8s/overlays/gpu-multi-node": {cuda},
                "k8s/overlays/trainjob-gpu": {cuda},
                # Local images by design: the one kind loads onto its node, and the example's derived image.
                "k8s/overlays/kind": {"ddp-deploy:latest"}, "k8s/overlays/example": {"ddp-forecast:latest"}}
    assert set(expected) == set(SOURCES)
    assert {source: images(render(source, k8s_copy)) for source in SOURCES} == expected
    checked = subprocess.run([sys.executable, str(k8s_copy / "scripts" / "k8s_image.py"), "--check"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stderr
    # Only IMAGE given: the CUDA image follows it (tests/deploy/test_k8s_images.py); nothing given: the files are
    # only brought in line.
    assert make_k8s_image(k8s_copy, "IMAGE=ddp-deploy:0.2.0").returncode == 0
    assert images(render("k8s/overlays/gpu-multi-node", k8s_copy)) == {"ddp-deploy:0.2.0-cuda"}
    assert images(render(PLAIN_DIR, k8s_copy)) == {"ddp-deploy:0.2.0"}


def test_a_hand_edit_of_the_image_component_is_caught_until_make_k8s_image_runs(k8s_copy):
    component = k8s_copy / "k8s" / "components" / "image" / "kustomization.yaml"
    component.write_text(component.read_text().replace('newTag: "latest"', 'newTag: "0.3.0"', 1))
    script = [sys.executable, str(k8s_copy / "scripts" / "k8s_image.py")]
    stale = subprocess.run([*script, "--check"], capture_output=True, text=True, timeout=60, check=False)
    assert (stale.returncode, stale.stderr) == (1, "error: k8s/pytorchjob.yaml is out of date: run make k8s-image\n")
    assert make_k8s_image(k8s_copy).returncode == 0
    assert images(render(PLAIN_DIR, k8s_copy)) == images(render("k8s/base", k8s_copy)) == {"ddp-deploy:0.3.0"}


@pytest.mark.parametrize(("setting", "message"), [
    ("IMAGE=registry.example.com/team/ddp-deploy", "error: IMAGE=registry.example.com/team/ddp-deploy names no "
     "tag: give the version (e.g. registry.example.com/team/ddp-deploy:0.1.0); nodes keep an image they have "
     "(imagePullPolicy: IfNotPresent), so a moving tag goes stale"),
    ("IMAGE=https://registry.example.com/ddp-deploy:1", "error: IMAGE=https://registry.example.com/ddp-deploy:1 is "
     "not an image reference: [host[:port]/]path:tag, lower case, no scheme (e.g. "
     "IMAGE=registry.example.com/team/ddp-deploy:0.1.0)"),
    ("CUDA_IMAGE=Registry/DDP:cuda", "error: CUDA_IMAGE=Registry/DDP:cuda is not an image reference"),
    (f"IMAGE=registry.example.com/ddp-deploy@sha256:{'a' * 64}", "error: IMAGE=registry.example.com/ddp-deploy@"
     f"sha256:{'a' * 64} names its image by digest alone, so the CUDA build's cannot be derived from it: give "
     "CUDA_IMAGE too"),
])
def test_a_bad_image_reference_is_refused_in_one_line_and_changes_nothing(k8s_copy, setting, message):
    before = {path: path.read_text() for path in (k8s_copy / "k8s").rglob("*.yaml")}
    made = make_k8s_image(k8s_copy, setting)
    assert made.returncode != 0
    (line,) = [line for line in made.stderr.splitlines() if not line.startswith("make")]
    assert line.startswith(message), line
    assert {path: path.read_text() for path in before} == before


def test_the_trainjob_s_network_policy_selects_the_labels_its_pods_carry():
    """JobSet labels the pods of a TrainJob with jobset.sigs.k8s.io/jobset-name (the TrainJob's name); they
    carry no training.kubeflow.org/job-name, so a policy selecting that would isolate nothing of the job."""
    objects = render("k8s/trainer-v2")
    (trainjob,) = of_kind(objects, "TrainJob")
    (policy,) = of_kind(objects, "NetworkPolicy")
    own_pods = {"matchLabels": {"jobset.sigs.k8s.io/jobset-name": trainjob["metadata"]["name"]}}
    assert policy["spec"]["podSelector"] == own_pods
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": own_pods}]}]


# --- who the job is: the namespace and the job's name, through the downward API -----------------------------

def job_variables(plan: PodPlan) -> dict[str, str]:
    """The DDP_* variables of a pod's container as the kubelet resolves them (downward API, $(NAME))."""
    from tests.support.k8s_pods import environment

    container = {**plan.container, "env": [e for e in plan.container.get("env", []) if e["name"].startswith("DDP_")]}
    return environment(dataclasses.replace(plan, template={"spec": {"containers": [container]}}, operator_env=()))


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_two_jobs_of_one_name_in_two_namespaces_are_two_jobs_and_a_recreated_pod_the_same(source):
    """MASTER_ADDR (<job>-master-0) is unique within a namespace only: the manifests name the job for the
    checkpoint folder's lease by namespace and job (DDP_JOB_ID from the downward API), which the trainer reads
    before any launcher's own name, whether it runs directly or under torchrun."""
    from tests.support.k8s_pods import environment
    from trainer.launchers import identity_from_env

    (job,) = of_kind(render(source), "PyTorchJob")
    for namespace in ("team-a", "team-b"):
        job["metadata"]["namespace"] = namespace
        named = {job_variables(plan)["DDP_JOB_ID"] for plan in pod_plans(job)}
        assert named == {f"pytorchjob/{namespace}/ddp-train"}, "every pod of one job, and only that job"
    if source == "k8s/base":  # the trainer started directly in each pod: its identity, recreated pod included
        plan = pod_plans(job)[-1]
        for hostname in (plan.name, "recreated"):
            identity = identity_from_env(environment(plan), hostname=hostname)
            assert (identity.job, identity.job_named) == ("pytorchjob/team-b/ddp-train", True)


def test_a_trainjobs_nodes_are_named_by_namespace_and_trainjob():
    (trainjob,) = of_kind(render("k8s/trainer-v2"), "TrainJob")
    trainjob["metadata"]["namespace"] = "team-a"
    assert {job_variables(plan)["DDP_JOB_ID"] for plan in trainer_v2_pods(trainjob)} == {"trainjob/team-a/ddp-train"}
