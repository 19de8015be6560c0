"""/dev/shm is counted in the memory it is charged to (docs/kubernetes.md, "Shared memory"): the pages of a
memory-backed emptyDir count against the pod's memory limit, so every pod that has one requests and limits at least
its sizeLimit plus the working memory of the trainer processes it runs, and a full /dev/shm is never the OOM kill.

Every source is rendered as the cluster receives it, its pods as their operator makes them (tests/support/job_pods.py).
"""

from __future__ import annotations

import pytest

from tests.support.job_pods import pod_templates, the_job
from tests.support.k8s_manifests import SOURCES, Obj, render
from tests.support.k8s_pods import QUANTITY_SUFFIXES

RAYJOB_SOURCES = ("k8s/ray", "k8s/overlays/rayjob-streamed-data")
GiB = 2**30
# The least working memory of one trainer process, /dev/shm apart: a rank of the bundled task peaks at 1.2 GB
# resident on CPU (measured with /usr/bin/time on `ddp-train --config` of k8s/base/configmap.yaml); a CUDA rank adds
# its context and the CUDA libraries' host memory. The overlays give more (4 GiB a GPU rank, 3 GiB a CPU rank).
WORKING_MEMORY_PER_PROCESS = {"cpu": 1.5 * GiB, "gpu": 3 * GiB}


def quantity_bytes(value: str | int) -> float:
    text = str(value)
    suffix = next((s for s in sorted(QUANTITY_SUFFIXES, key=len, reverse=True) if text.endswith(s)), "")
    return float(text.removesuffix(suffix)) * QUANTITY_SUFFIXES.get(suffix, 1)


def memory_volumes(pod: Obj) -> list[Obj]:
    return [v for v in pod["spec"].get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"]


def pods_with_shared_memory(source: str) -> list[Obj]:
    pods = [pod for pod in pod_templates(the_job(render(source))) if memory_volumes(pod)]
    assert pods, f"{source}: no pod with a memory-backed volume; nothing to check"
    return pods


def gpus(pod: Obj) -> int:
    return sum(int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
               for c in pod["spec"]["containers"])


def memory(pod: Obj, bound: str) -> float:
    """The pod's memory request or limit while it runs: its containers' together (init containers have finished)."""
    return sum(quantity_bytes(c["resources"][bound]["memory"]) for c in pod["spec"]["containers"])


@pytest.mark.parametrize("source", (*SOURCES, *RAYJOB_SOURCES))
def test_every_memory_backed_volume_has_a_size_limit(source):
    # Without one a tmpfs emptyDir may grow to the pod's whole memory limit.
    for pod in pods_with_shared_memory(source):
        assert all("sizeLimit" in v["emptyDir"] for v in memory_volumes(pod)), memory_volumes(pod)


@pytest.mark.parametrize("source", (*SOURCES, *RAYJOB_SOURCES))
def test_memory_request_and_limit_hold_the_shared_memory_and_the_processes_working_memory(source):
    for pod in pods_with_shared_memory(source):
        shared = sum(quantity_bytes(v["emptyDir"]["sizeLimit"]) for v in memory_volumes(pod))
        # One trainer process per GPU, one on a CPU pod (test_k8s_manifests checks nprocPerNode so).
        working = max(1, gpus(pod)) * WORKING_MEMORY_PER_PROCESS["gpu" if gpus(pod) else "cpu"]
        for bound in ("requests", "limits"):
            assert memory(pod, bound) >= shared + working, (
                f"{source}: memory {bound} {memory(pod, bound) / GiB:g} GiB < /dev/shm {shared / GiB:g} GiB + "
                f"working memory {working / GiB:g} GiB")

