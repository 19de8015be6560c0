"""Each PyTorchJob, executed: its pods started with what the training operator v1.9 gives them.

The pods run the job's command and args unchanged, as processes on this machine (tests/support/k8s_processes.py)
and, where Docker and the job's image are there, as containers of that image (tests/support/k8s_containers.py).
The only change is to the ConfigMap's content, the way a user edits it: a short run (one epoch of 512
samples), and, on a machine without GPUs, the GPU jobs' device and backend set to cpu and gloo.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.support.k8s_containers import docker, image_present, run_containers
from tests.support.k8s_manifests import SHARED_CLAIM, config_maps, of_kind, render
from tests.support.k8s_operator import PodPlan, admission_errors, pod_plans
from tests.support.k8s_pods import Pod, PodResult, prepare
from tests.support.k8s_processes import PodLoss, run_processes
from tests.support.preconditions import unavailable
from tests.support.trainer_v2 import admission_errors as trainjob_admission_errors
from tests.support.trainer_v2 import pod_plans as trainer_v2_pods

pytestmark = pytest.mark.slow

PYTORCHJOB_SOURCES = ("k8s", "k8s/overlays/kind", "k8s/overlays/elastic", "k8s/overlays/gpu-single-node",
                      "k8s/overlays/gpu-multi-node", "k8s/overlays/example", "k8s/overlays/sharded")
CONFIG_MAP, CONFIG_KEY, CLAIM = "ddp-train-config", "config.yaml", SHARED_CLAIM
SHORT_RUN = {"train": {"epochs": 1}, "data": {"max_train_samples": 512, "max_test_samples": 256}}
WITHOUT_GPUS = {"dist": {"device": "cpu", "backend": "gloo"}}
# The image has the trainer on PATH in /opt/venv/bin; here the venv the tests run in has it.
BIN_DIR = Path(sys.executable).parent
TIMEOUT_S = 300
Runner = Callable[[list[Pod], Path], list[PodResult]]


def as_processes(pods: list[Pod], workdir: Path) -> list[PodResult]:
    if os.geteuid() != 0:
        unavailable("pods run as processes in mount namespaces of their own: root only")
    if shutil.which("ddp-train", path=str(BIN_DIR)) is None:
        pytest.fail(f"ddp-train is not in {BIN_DIR}: install the project into the venv (make venv)")
    return run_processes(pods, workdir, BIN_DIR, TIMEOUT_S)


def as_containers(pods: list[Pod], workdir: Path) -> list[PodResult]:
    if shutil.which("docker") is None or docker("info").returncode != 0:
        unavailable("no Docker engine answers (.ci/run starts one)")
    for image in {pod.image for pod in pods}:
        if not image_present(image):
            unavailable(f"image {image} is not built here (.ci/docker-setup.sh builds ddp-deploy:latest)")
    return run_containers(pods, TIMEOUT_S)


def edited(text: str, *changes: dict[str, dict[str, Any]]) -> str:
    config = yaml.safe_load(text)
    for change in changes:
        for section, values in change.items():
            config.setdefault(section, {}).update(values)
    return yaml.safe_dump(config)


def run_job(source: str, run: Runner, workdir: Path, claim: Path, *changes: dict[str, dict[str, Any]]
            ) -> list[Pod]:
    """Apply the job once: start its pods with the edited ConfigMap and the claim's folder; all exit 0."""
    objects = render(source)
    (job,) = of_kind(objects, "PyTorchJob")
    assert admission_errors(job) == []
    if not torch.cuda.is_available():
        changes = (*changes, WITHOUT_GPUS)
    pods = prepared(source, pod_plans(job), workdir, claim, *changes)
    results = run(pods, workdir)
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n".join(f"--- pod {r.name} exited {r.returncode}:\n{r.log[-4000:]}" for r in failed)
    return pods


def prepared(source: str, plans: list[PodPlan], workdir: Path, claim: Path, *changes: dict[str, dict[str, Any]]
             ) -> list[Pod]:
    """Each planned pod made concrete in a folder of its own under ``workdir``: the source's ConfigMap edited by
    ``changes``, the claim's folder as its volume."""
    maps = config_maps(render(source))
    maps[CONFIG_MAP][CONFIG_KEY] = edited(maps[CONFIG_MAP][CONFIG_KEY], *changes)
    pods = []
    for plan in plans:
        (workdir / plan.name).mkdir(parents=True)
        pods.append(prepare(plan, maps, {CLAIM: claim}, workdir / plan.name))
    return pods


def summary(claim: Path, source: str) -> dict[str, Any]:
    # The job's pods mount the shared claim at /mnt/ddp and write under /mnt/ddp/JOB (--output-dir in their args).
    (job,) = [obj for obj in render(source) if obj["kind"] in ("PyTorchJob", "TrainJob")]
    return json.loads((claim / job["metadata"]["name"] / "summary.json").read_text())


def trains_with_every_rank(source: str, run: Runner, tmp_path: Path) -> None:
    claim = tmp_path / "claim"
    claim.mkdir()
    pods = run_job(source, run, tmp_path / "pods", claim, SHORT_RUN)
    (job,) = of_kind(render(source), "PyTorchJob")
    world_size = len(pods) * int(job["spec"]["nprocPerNode"])
    result = summary(claim, source)
    assert result["world_size"] == world_size
    assert sorted(rank["rank"] for rank in result["ranks"]) == list(range(world_size))
    assert {rank["hostname"] for rank in result["ranks"]} == {pod.name for pod in pods}
    assert result["epochs_completed"] == 1 and result["test_samples"] == 256


@pytest.mark.parametrize("source", PYTORCHJOB_SOURCES)
def test_job_trains_to_the_end_with_every_rank_of_every_pod(source, tmp_path):
    trains_with_every_rank(source, as_processes, tmp_path)


@pytest.mark.docker
@pytest.mark.parametrize("source", ("k8s", "k8s/overlays/elastic", "k8s/overlays/example"))
def test_job_trains_with_every_rank_in_containers_of_its_image(source, tmp_path):
    trains_with_every_rank(source, as_containers, tmp_path)


def test_job_applied_again_after_deletion_resumes_from_the_volume(tmp_path):
    claim = tmp_path / "claim"
    claim.mkdir()
    run_job("k8s", as_processes, tmp_path / "first", claim, SHORT_RUN)
    first = summary(claim, "k8s")
    # The job is deleted and applied again with one more epoch; the claim (and its checkpoints) stays.
    run_job("k8s", as_processes, tmp_path / "second", claim, SHORT_RUN, {"train": {"epochs": 2}})
    second = summary(claim, "k8s")
    assert first["resumed_from"] is None
    assert second["resumed_from"] == f"/mnt/ddp/ddp-train/checkpoints/step-{first['global_step']:08d}"
    assert second["epochs_completed"] == 2 and second["global_step"] == 2 * first["global_step"]


def loses_a_pod_and_goes_on_alone(source: str, plans: list[PodPlan], tmp_path: Path) -> None:
    """The elastic job of ``source`` (two pods, at least one) started as ``plans`` says; the second pod is lost
    mid-epoch (every process of it killed, as its node going down does), the first one's torchrun re-forms the job
    alone and resumes from the newest checkpoint, and trains every sample of the epoch once."""
    samples, batch = 2048, 8
    long_enough = {"train": {"epochs": 1, "batch_size": batch}, "checkpoint": {"checkpoint_every": 10},
                   "data": {"max_train_samples": samples, "max_test_samples": 256}}
    claim = tmp_path / "claim"
    claim.mkdir()
    pods = prepared(source, plans, tmp_path / "pods", claim, long_enough, WITHOUT_GPUS)
    if os.geteuid() != 0:
        unavailable("pods run as processes in mount namespaces of their own: root only")
    first, second = (pod.name for pod in pods)
    loss = PodLoss(second, seen_in=first, when=lambda log: "step-00000010 written" in log)
    results = {result.name: result for result in run_processes(pods, tmp_path / "pods", BIN_DIR, TIMEOUT_S, loss)}
    survivor, lost = results[first], results[second]
    assert survivor.returncode == 0 and lost.returncode == -signal.SIGKILL, (survivor.log[-4000:], lost.log[-2000:])
    final = summary(claim, source)
    assert final["world_size"] == 1 and final["epochs_completed"] == 1, survivor.log[-4000:]
    resumed = int(final["resumed_from"].rsplit("step-", 1)[1])
    # Each step before the checkpoint resumed trained 2 x 8 samples, each one after it 8: the epoch's samples once.
    assert resumed >= 10 and final["global_step"] == resumed + (samples - resumed * 2 * batch) // batch, final


def test_the_elastic_job_loses_a_pod_and_the_other_goes_on_alone_training_every_sample_once(tmp_path):
    """k8s/overlays/elastic (minReplicas 1, maxReplicas 2): worker-1's pod is lost. What a cluster adds (the
    operator does not start a replacement pod for an elastic job whose pod failed: maxRestarts counts torchrun's
    restarts) is in docs/kubernetes.md."""
    (job,) = of_kind(render("k8s/overlays/elastic"), "PyTorchJob")
    plans = pod_plans(job)
    assert [plan.name for plan in plans] == ["ddp-train-worker-0", "ddp-train-worker-1"]
    loses_a_pod_and_goes_on_alone("k8s/overlays/elastic", plans, tmp_path)


def test_the_elastic_trainjob_loses_a_node_and_the_other_goes_on_alone_training_every_sample_once(tmp_path):
    """k8s/overlays/trainjob-elastic (--nnodes=1:2, numNodes 2) with the pods and variables Trainer v2 and JobSet
    give it (tests/support/trainer_v2.py): node 0 serves the rendezvous at PET_MASTER_ADDR, the name JobSet's
    headless Service gives it; node 1's pod is lost. What a cluster adds (the Job controller replaces the failed
    pod, which joins) is in docs/kubernetes.md."""
    (trainjob,) = of_kind(render("k8s/overlays/trainjob-elastic"), "TrainJob")
    assert trainjob_admission_errors(trainjob) == []
    plans = trainer_v2_pods(trainjob)
    assert [plan.name for plan in plans] == ["ddp-train-node-0-0", "ddp-train-node-0-1"]
    loses_a_pod_and_goes_on_alone("k8s/overlays/trainjob-elastic", plans, tmp_path)


def test_torchrun_exits_1_after_sigterm_even_when_its_workers_exit_143(tmp_path):
    # Why the torchrun jobs restart OnFailure: under ExitCode a preempted pod would fail the job.
    worker = tmp_path / "worker.py"
    worker.write_text("import pathlib, signal, sys\n"
                      "def preempted(*_):\n"
                      f"    pathlib.Path({str(tmp_path / 'exited-143')!r}).touch()\n"
                      "    sys.exit(143)\n"
                      "signal.signal(signal.SIGTERM, preempted)\n"
                      "print('ready', flush=True)\n"
                      "signal.pause()\n")
    command = [str(BIN_DIR / "torchrun"), "--standalone", "--nproc-per-node=1", str(worker)]
    torchrun = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert torchrun.stdout is not None
    for line in torchrun.stdout:
        if line.strip() == "ready":
            break
    else:
        raise AssertionError(f"the worker never started; torchrun exited {torchrun.wait()}")
    torchrun.send_signal(signal.SIGTERM)
    output, _ = torchrun.communicate(timeout=120)
    assert (tmp_path / "exited-143").exists(), output
    assert torchrun.returncode == 1, output
