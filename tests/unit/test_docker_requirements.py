"""docker/requirements.py: the image's requirement list, with the EXTRAS build argument's extras."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from devtools.processes import REPO_ROOT

SCRIPT = REPO_ROOT / "docker" / "requirements.py"
PYPROJECT = REPO_ROOT / "pyproject.toml"


def listed(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(PYPROJECT), *arguments],
                          capture_output=True, text=True, timeout=60)


def project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def test_the_default_list_is_the_dependencies_and_the_tested_pins():
    result = listed()
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == project()["dependencies"] + project()["optional-dependencies"]["tested"]


def test_extras_add_the_trackers_clients_after_the_default_list():
    default = listed().stdout.splitlines()
    result = listed("--extras", "mlflow,wandb", "--build-system")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    optional = project()["optional-dependencies"]
    assert lines[:len(default)] == default
    assert lines[len(default):] == optional["mlflow"] + optional["wandb"] + ["setuptools>=77"]


def test_an_extra_naming_the_package_itself_is_replaced_by_that_extras_list():
    lines = listed("--extras", "dev").stdout.splitlines()
    assert not [line for line in lines if line.startswith("ddp-deploy")], lines
    optional = project()["optional-dependencies"]
    for extra in ("mlflow", "wandb", "s3", "bench"):
        assert set(optional[extra]) <= set(lines), extra
    assert len(lines) == len(set(lines)), "a requirement listed twice"


def test_an_unknown_extra_is_one_line_naming_the_choices():
    result = listed("--extras", "mlfow")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "no extra 'mlfow' in pyproject.toml; choose from" in result.stderr and "mlflow" in result.stderr
    assert "EXTRAS build argument" in result.stderr
    assert listed("--extras").returncode == 2
