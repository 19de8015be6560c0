"""The kind recipe (make kind-up, kind-test, kind-down) cannot run here: it is linted and cross-checked."""

from __future__ import annotations

import subprocess

import yaml

from tests.support.k8s_manifests import K8S_DIR, REPO_ROOT


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
