"""A TrainJob checked against the API of each Kubeflow Trainer release, offline: the TrainJob CRD's schema of the
release (tests/fixtures/trainer-trainjob-<tag>.schema.json, made by scripts/crd_schema.py from
manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml at the tag), strictly, as the API server checks it under
kubectl's default strict field validation: a field the release does not declare, a value of the wrong type, or two
items of a list map with the same keys (two env entries of one name; tests/support/structural_schema.py) is an
error. PyPI's kubeflow-trainer-api (tests/support/kubeflow_api.py) is one release, 2.3.0; these are every minor.

The newest patch release of each minor: with their descriptions left out, v2.0.0's schema is v2.0.1's and v2.2.0's is
v2.2.1's (compared when the fixtures were made).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from devtools.processes import REPO_ROOT
from tests.support.structural_schema import schema_errors

Obj = dict[str, Any]
RELEASES = ("v2.0.1", "v2.1.0", "v2.2.1", "v2.3.0")


@functools.cache
def schema(release: str) -> Obj:
    """The release's TrainJob schema as JSON Schema (its ``source`` names the file and tag it came from)."""
    return json.loads((REPO_ROOT / "tests" / "fixtures" / f"trainer-trainjob-{release}.schema.json").read_text())


def crd_errors(trainjob: Obj, release: str) -> list[str]:
    """Where the TrainJob breaks the release's schema: "path: message" each; [] when the release accepts it."""
    release_schema = schema(release)
    if trainjob.get("apiVersion") != release_schema["apiVersion"]:
        return [f"apiVersion: {trainjob.get('apiVersion')!r} is not {release_schema['apiVersion']!r}"]
    return schema_errors(trainjob, release_schema)
