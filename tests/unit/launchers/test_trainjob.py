"""Kubeflow Trainer v2: PET_* alone."""

from __future__ import annotations

import pytest

from trainer.errors import LaunchEnvError
from trainer.launchers import StatusServer, identity_from_env, status_server_from_env, without_launcher_variables


def test_trainer_v2_pet_variables_alone_ask_for_torchrun():
    env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "t-node-0-0.t",
           "PET_MASTER_PORT": "29500"}
    with pytest.raises(LaunchEnvError, match="PET_.*torchrun"):
        identity_from_env(env)


def test_the_status_server_is_read_with_its_files_paths_and_not_passed_on():
    env = {"KUBEFLOW_TRAINER_SERVER_URL": " https://kubeflow-trainer-controller-manager.kubeflow-system.svc:10443/apis/"
                                          "trainer.kubeflow.org/v1alpha1/namespaces/a/trainjobs/b/status ",
           "KUBEFLOW_TRAINER_SERVER_CA_CERT": "/var/run/secrets/kubeflow/trainer/ca.crt",
           "KUBEFLOW_TRAINER_SERVER_TOKEN": "/var/run/secrets/kubeflow/trainer/token", "HOME": "/root"}
    assert status_server_from_env(env) == StatusServer(
        "https://kubeflow-trainer-controller-manager.kubeflow-system.svc:10443/apis/trainer.kubeflow.org/v1alpha1/"
        "namespaces/a/trainjobs/b/status", "/var/run/secrets/kubeflow/trainer/token",
        "/var/run/secrets/kubeflow/trainer/ca.crt")
    assert status_server_from_env({"KUBEFLOW_TRAINER_SERVER_URL": " "}) is None
    assert status_server_from_env({}) is None
    assert without_launcher_variables(env) == {"HOME": "/root"}  # a child process is not this job's reporter
