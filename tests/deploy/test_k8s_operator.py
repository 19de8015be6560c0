"""The emulated training operator (tests/support/k8s_operator.py) gives the variables operator v1.9 gives."""

from __future__ import annotations

from tests.support.k8s_operator import admission_errors, pod_plans


def job(replicas: dict[str, int], **spec: object) -> dict:
    template = {"spec": {"containers": [{"name": "pytorch", "image": "ddp-deploy:latest"}]}}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "mnist"},
            "spec": {"pytorchReplicaSpecs": {rtype: {"replicas": n, "template": template}
                                             for rtype, n in replicas.items()}, **spec}}


def test_master_and_workers_get_the_master_address_world_size_and_their_node_rank():
    plans = pod_plans(job({"Master": 1, "Worker": 2}, nprocPerNode="2"))
    assert [p.name for p in plans] == ["mnist-master-0", "mnist-worker-0", "mnist-worker-1"]
    assert dict(plans[2].operator_env) == {
        "PYTHONUNBUFFERED": "1", "MASTER_PORT": "23456", "PET_MASTER_PORT": "23456",
        "MASTER_ADDR": "mnist-master-0", "PET_MASTER_ADDR": "mnist-master-0", "WORLD_SIZE": "6",
        "RANK": "2", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "2", "PET_NNODES": "3"}
    assert [dict(p.operator_env)["RANK"] for p in plans] == ["0", "1", "2"]


def test_default_nproc_per_node_is_auto_and_counts_as_one_process_per_pod():
    _, worker = pod_plans(job({"Master": 1, "Worker": 1}))
    assert dict(worker.operator_env)["PET_NPROC_PER_NODE"] == "auto"
    assert dict(worker.operator_env)["WORLD_SIZE"] == "2"


def test_elastic_workers_get_the_rendezvous_on_the_first_worker_and_node_bounds():
    elastic = {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 3, "maxRestarts": 2}
    plans = pod_plans(job({"Worker": 2}, elasticPolicy=elastic))
    env = dict(plans[1].operator_env)
    assert env == {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": "auto",
                   "PET_RDZV_ENDPOINT": "mnist-worker-0:23456", "PET_RDZV_BACKEND": "c10d",
                   "PET_NNODES": "1:3", "PET_MAX_RESTARTS": "2"}


def test_elastic_bounds_default_to_the_number_of_workers():
    (worker, *_) = pod_plans(job({"Worker": 4}, elasticPolicy={}))
    assert dict(worker.operator_env)["PET_NNODES"] == "4:4"


def test_webhook_refuses_two_masters_and_pods_without_a_pytorch_container():
    two_masters = job({"Master": 2})
    assert admission_errors(two_masters) == ["pytorchReplicaSpecs.Master.replicas must be 1"]
    unnamed = job({"Worker": 1})
    unnamed["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "main"
    assert admission_errors(unnamed) == ["pytorchReplicaSpecs.Worker: needs a container named 'pytorch'"]


def test_workers_of_a_job_with_a_master_get_the_operators_init_container_after_their_own():
    with_master = job({"Master": 1, "Worker": 2})
    with_master["spec"]["pytorchReplicaSpecs"]["Worker"]["template"] = {"spec": {
        "initContainers": [{"name": "own"}], "containers": [{"name": "pytorch", "image": "ddp-deploy:latest"}]}}
    master, *workers = pod_plans(with_master)
    assert "initContainers" not in master.template["spec"]
    for worker in workers:
        own, waiting = worker.template["spec"]["initContainers"]
        assert own == {"name": "own"} and waiting["name"] == "init-pytorch"
        assert waiting["image"] == "alpine:3.10" and "mnist-master-0" in waiting["command"][-1]
        assert "securityContext" not in waiting, "the operator's built-in template sets none"


def test_an_init_container_template_of_the_operators_flag_replaces_the_built_in_one_and_elastic_jobs_get_none():
    template = "- name: init-pytorch\n  image: '{{.InitContainerImage}}'\n  command: ['{{ .MasterAddr }}']\n"
    _, worker = pod_plans(job({"Master": 1, "Worker": 1}), template)
    assert worker.template["spec"]["initContainers"] == [
        {"name": "init-pytorch", "image": "alpine:3.10", "command": ["mnist-master-0"]}]
    for plan in pod_plans(job({"Worker": 2}, elasticPolicy={}), template):
        assert "initContainers" not in plan.template["spec"], plan.name
