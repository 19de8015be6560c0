"""Kubeflow Trainer v2 (TrainJob): it sets only ``PET_*``, torchrun's options, so its command must be torchrun
(then the torchrun dialect reads the variables torchrun sets). Started directly, the trainer refuses.

Its status server is read here too (``status_server_from_env``), whichever dialect reads the identity."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainer.errors import LaunchEnvError
from trainer.launchers.base import TORCHRUN_HINT, LaunchEnv, Launcher
from trainer.launchers.identity import DistIdentity

# Kubeflow Trainer >= 2.2 with its TrainJobStatus feature gate on (alpha, off by default) puts these into every
# trainer container (pkg/runtime/framework/plugins/trainjobstatus/trainjobstatus.go): the status server's URL,
# and the paths, not the contents, of its CA certificate and of a projected service-account token (the
# TrainJob's own audience, valid for an hour and renewed in place by the kubelet: read it at each request).
STATUS_URL = "KUBEFLOW_TRAINER_SERVER_URL"
STATUS_CA_CERT = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
STATUS_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"


@dataclass(frozen=True)
class StatusServer:
    """Where rank 0 reports the TrainJob's progress (trainer.trainjob_progress)."""

    url: str  # https://<controller service>:10443/apis/trainer.kubeflow.org/v1alpha1/namespaces/N/trainjobs/J/status
    token_file: str  # the bearer token's file
    ca_cert_file: str  # the CA certificate's file ("": the system's trust store)


def status_server_from_env(env: Mapping[str, str]) -> StatusServer | None:
    """The TrainJob's status server, where the controller named one (None elsewhere)."""
    url = env.get(STATUS_URL, "").strip()
    if not url:
        return None
    return StatusServer(url, env.get(STATUS_TOKEN, "").strip(), env.get(STATUS_CA_CERT, "").strip())


class TrainJob(Launcher):
    name = "trainjob"
    # Not the identity's, but a child process (a nested launcher, a test) must not report as this job either.
    variables = (STATUS_URL, STATUS_CA_CERT, STATUS_TOKEN)
    prefixes = ("PET_",)

    def detect(self, env: LaunchEnv) -> bool:
        return not env.launched() and bool(env.prefixed("PET_"))

    def identity(self, env: LaunchEnv) -> DistIdentity:
        raise LaunchEnvError(f"{', '.join(env.prefixed('PET_'))} set but RANK and WORLD_SIZE are not: PET_* "
                             f"variables are torchrun's options (Kubeflow Trainer sets only these); {TORCHRUN_HINT}")
