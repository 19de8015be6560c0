"""Retries with an end: what each job does with each exit code, as the README's table says, and a deadline on
every job, set in one place per kind of job."""

from __future__ import annotations

import re

import pytest

from tests.support.k8s_manifests import K8S_DIR, REPO_ROOT, SOURCES, of_kind, render
from tests.support.k8s_operator import CONTAINER, retries

RAYJOB_SOURCES = ("k8s/ray", "k8s/overlays/rayjob-streamed-data")
# Where each kind of job reads its deadline: the PyTorchJob's runPolicy, the TrainJob's and the RayJob's spec.
DEADLINE = {"PyTorchJob": ("spec", "runPolicy", "activeDeadlineSeconds"),
            "TrainJob": ("spec", "activeDeadlineSeconds"), "RayJob": ("spec", "activeDeadlineSeconds")}
# The one file per kind that sets it; k8s/pytorchjob.yaml is the base's copy for `kubectl apply -f k8s/`.
DEADLINE_FILES = {"k8s/base/pytorchjob.yaml", "k8s/pytorchjob.yaml", "k8s/trainer-v2/trainjob.yaml",
                  "k8s/ray/rayjob.yaml"}


def exit_code_table() -> dict[int, bool]:
    """The README's "Exit codes" table: each code and whether it is retried."""
    section = REPO_ROOT.joinpath("README.md").read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| .* \| (yes|no)\b.*\|$", section, flags=re.MULTILINE)
    return {int(code): retry == "yes" for code, retry in rows}


def test_the_readme_table_names_the_codes_kubernetes_jobs_meet():
    table = exit_code_table()
    assert {1, 2, 3, 137, 143, 200} <= set(table), table


@pytest.mark.parametrize("source", SOURCES)
def test_each_replica_s_restart_policy_retries_what_the_readme_table_says(source):
    for job in of_kind(render(source), "PyTorchJob"):
        for rtype, replica in job["spec"]["pytorchReplicaSpecs"].items():
            policy = replica["restartPolicy"]
            (container,) = [c for c in replica["template"]["spec"]["containers"] if c["name"] == CONTAINER]
            if policy == "ExitCode":
                assert {code: retries(policy, code) for code in exit_code_table()} == exit_code_table(), rtype
            else:
                # torchrun exits 1 whatever its workers did: every failure is retried, up to backoffLimit restarts
                # (container restarts in place, which the operator's backoff count sees).
                assert (container["command"], policy) == (["torchrun"], "OnFailure"), rtype
                assert job["spec"]["runPolicy"]["backoffLimit"] >= 1


@pytest.mark.parametrize("source", (*SOURCES, *RAYJOB_SOURCES))
def test_every_job_has_a_deadline_that_ends_its_retries(source):
    jobs = [obj for obj in render(source) if obj["kind"] in DEADLINE]
    assert jobs, source
    for job in jobs:
        value = job
        for key in DEADLINE[job["kind"]]:
            value = value.get(key, {})
        assert isinstance(value, int) and 3600 <= value <= 7 * 86400, f"{job['kind']}: {value!r}"


def test_each_kind_of_job_sets_its_deadline_in_one_place():
    setting = {path.relative_to(K8S_DIR.parent).as_posix() for path in K8S_DIR.rglob("*.yaml")
               if not path.is_symlink() and "activeDeadlineSeconds:" in path.read_text()}
    assert setting == DEADLINE_FILES
