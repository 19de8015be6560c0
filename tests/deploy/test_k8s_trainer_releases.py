"""The Kubeflow Trainer releases the TrainJobs run on (docs/kubernetes.md, "Trainer releases"): every TrainJob checked
against the TrainJob API of each release, its CRD's schema (tests/support/trainer_crds.py), and the docs' table held
to what those schemas declare.

Where the releases differ for these manifests, in pkg/apis/trainer/v1alpha1/trainjob_types.go at each tag of
kubeflow/trainer: v2.0.0 and v2.0.1 change the runtime's pods through spec.podSpecOverrides (PodSpecOverride: no
metadata, no securityContext) and v2.1.0 through spec.podTemplateOverrides (PodTemplateOverride: metadata, but no
securityContext), both with a numProcPerNode that is an IntOrString and no spec.activeDeadlineSeconds; v2.2.0 replaces
both with spec.runtimePatches (PodSpecPatch and ContainerPatch with securityContext), adds activeDeadlineSeconds and
makes numProcPerNode an *int32; v2.3.0 adds PodSpecPatch.terminationGracePeriodSeconds. The webhook's rule for a
patch's manager is pkg/runtime/framework/plugins/jobset/jobset.go (Validate) from v2.2.0 on.
"""

from __future__ import annotations

import re

import pytest

from tests.support.k8s_manifests import REPO_ROOT, TRAINJOB_SOURCES, Obj, of_kind, render
from tests.support.trainer_crds import RELEASES, crd_errors, schema
from tests.support.trainer_v2 import admission_errors

# Where the TrainJob's pod settings are, in the schema of each release.
POD_SETTINGS = {"v2.0.1": ("podSpecOverrides", ("items",)), "v2.1.0": ("podTemplateOverrides", ("items", "spec")),
                "v2.2.1": ("runtimePatches", ("items", "trainingRuntimeSpec", "template", "spec", "replicatedJobs",
                                              "items", "template", "spec", "template", "spec")),
                "v2.3.0": ("runtimePatches", ("items", "trainingRuntimeSpec", "template", "spec", "replicatedJobs",
                                              "items", "template", "spec", "template", "spec"))}
NODE_POD = "spec.runtimePatches.0.trainingRuntimeSpec.template.spec.replicatedJobs.0.template.spec.template.spec"
# What each release refuses of the manifests as written: nothing from v2.3.0 on.
NEWER_FIELDS = "spec: Additional properties are not allowed ('activeDeadlineSeconds', 'runtimePatches' were unexpected)"
REFUSED = {
    "v2.0.1": [NEWER_FIELDS],
    "v2.1.0": [NEWER_FIELDS],
    "v2.2.1": [f"{NODE_POD}: Additional properties are not allowed ('terminationGracePeriodSeconds' was unexpected)"],
    "v2.3.0": [],
}
TABLE_COLUMNS = ("release", "`k8s/trainer-v2` as written", "pod settings", "`securityContext`",
                 "`terminationGracePeriodSeconds`", "`activeDeadlineSeconds`", "`numProcPerNode`", "JobSet it installs")


def trainjob_of(source: str) -> Obj:
    (trainjob,) = of_kind(render(source), "TrainJob")
    return trainjob


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("source", TRAINJOB_SOURCES)
def test_trainer_2_3_accepts_every_trainjob_and_older_releases_refuse_only_the_fields_they_lack(source, release):
    assert crd_errors(trainjob_of(source), release) == REFUSED[release]


@pytest.mark.parametrize("release", RELEASES)
def test_a_number_of_processes_of_auto_is_refused_from_trainer_2_2_on(release):
    """"auto" was a value of 2.0 and 2.1; from 2.2 it is what Trainer passes torchrun when numProcPerNode is unset."""
    trainjob = trainjob_of("k8s/trainer-v2")
    trainjob["spec"]["trainer"]["numProcPerNode"] = "auto"
    refused = [error for error in crd_errors(trainjob, release) if error.startswith("spec.trainer.numProcPerNode")]
    assert refused == ([] if release in ("v2.0.1", "v2.1.0") else ["spec.trainer.numProcPerNode: 'auto' is not of "
                                                                    "type 'integer'"])


@pytest.mark.parametrize("release", RELEASES)
def test_a_second_env_entry_of_one_name_is_refused_by_every_release(release):
    """The CRD makes the trainer's env a list map keyed by name: the API server refuses the TrainJob ("Duplicate
    value"), say when two components each add the store's key."""
    trainjob = trainjob_of("k8s/trainer-v2")
    env = trainjob["spec"]["trainer"]["env"]
    env += [{"name": "AWS_ACCESS_KEY_ID", "value": "a"}, {"name": "AWS_ACCESS_KEY_ID", "value": "b"}]
    duplicated = [error for error in crd_errors(trainjob, release) if error.startswith("spec.trainer.env")]
    assert duplicated == [f'spec.trainer.env.{len(env) - 1}: Duplicate value: {{"name": "AWS_ACCESS_KEY_ID"}} '
                          f"(item {len(env) - 2} has it)"]


@pytest.mark.parametrize("manager", ["ddp-deploy", "Example.com/ddp", "example.com/"])
def test_the_webhook_refuses_a_runtime_patch_whose_manager_is_not_a_domain_prefixed_path(manager):
    trainjob = trainjob_of("k8s/trainer-v2")
    assert admission_errors(trainjob) == []
    trainjob["spec"]["runtimePatches"][0]["manager"] = manager
    assert admission_errors(trainjob) == [f"spec.runtimePatches.manager: Invalid value: {manager!r}: must be a "
                                          'domain-prefixed path (such as "acme.io/foo")']


def releases_table() -> dict[str, dict[str, str]]:
    """docs/kubernetes.md's "Trainer releases" table: each release tag named in a row, with that row by column."""
    text = REPO_ROOT.joinpath("docs/kubernetes.md").read_text()
    section = text.split("### Trainer releases", 1)[1].split("\n#", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|")]
    assert tuple(rows[0]) == TABLE_COLUMNS, rows[0]
    table = {}
    for row in rows[2:]:
        for release in re.findall(r"`(v[0-9.]+)`", row[0]):
            table[release] = dict(zip(TABLE_COLUMNS, row, strict=True))
    return table


def yes_no(present: bool) -> str:
    return "yes" if present else "no"


@pytest.mark.parametrize("release", RELEASES)
def test_the_docs_table_says_what_each_release_s_api_declares(release):
    row = releases_table()[release]
    spec = schema(release)["properties"]["spec"]["properties"]
    field, path = POD_SETTINGS[release]
    pod = spec[field]
    for key in path:
        pod = pod[key] if key == "items" else pod["properties"][key]
    assert row["`k8s/trainer-v2` as written"] == yes_no(not REFUSED[release])
    assert row["pod settings"] == f"`{field}`"
    assert set(POD_SETTINGS[name][0] for name in RELEASES) & set(spec) == {field}, "one way to change the pods"
    container = pod["properties"]["containers"]["items"]["properties"]
    assert row["`securityContext`"] == yes_no("securityContext" in pod["properties"] and "securityContext" in container)
    assert row["`terminationGracePeriodSeconds`"] == yes_no("terminationGracePeriodSeconds" in pod["properties"])
    assert row["`activeDeadlineSeconds`"] == yes_no("activeDeadlineSeconds" in spec)
    processes = spec["trainer"]["properties"]["numProcPerNode"]
    assert row["`numProcPerNode`"] == ("a number or `auto`" if "anyOf" in processes else "a number")
