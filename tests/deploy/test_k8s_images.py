"""One image setting for every job (docs/kubernetes.md): `make k8s-image IMAGE=...` points every kind of job, the GPU
overlays at the CUDA build beside it, and `make push` pushes both builds under the tags those settings name."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.processes import REPO_ROOT
from tests.support.k8s_manifests import SOURCES, Obj, copy_for_make, make_k8s_image, render

RAYJOB_SOURCES = ("k8s/ray", "k8s/overlays/rayjob-streamed-data")
GPU_SOURCES = ("k8s/overlays/gpu-single-node", "k8s/overlays/gpu-multi-node", "k8s/overlays/trainjob-gpu")
# Local images by design: the one kind loads onto its node, and the worked example's derived image.
LOCAL_IMAGE_SOURCES = ("k8s/overlays/kind", "k8s/overlays/example")
OTHER_PROGRAMS = ("ghcr.io/mlflow/mlflow:",)  # the tracking overlay's MLflow server is not our image


def every_image(node: object) -> Iterator[str]:
    """Every `image:` value anywhere in an object: containers, init containers, a TrainJob's, a RayJob's submitter."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "image" and isinstance(value, str):
                yield value
            else:
                yield from every_image(value)
    elif isinstance(node, list):
        for item in node:
            yield from every_image(item)


def trainer_images(objects: list[Obj]) -> set[str]:
    return {image for image in every_image(objects) if not image.startswith(OTHER_PROGRAMS)}


def test_image_alone_points_every_job_of_every_kind_and_the_gpu_overlays_at_its_cuda_build(tmp_path):
    root = copy_for_make(tmp_path)
    cpu = "registry.example.com:5000/team/ddp-deploy:sha-0123456789ab"
    made = make_k8s_image(root, f"IMAGE={cpu}")
    assert made.returncode == 0, made.stdout + made.stderr
    sources = [source for source in (*SOURCES, *RAYJOB_SOURCES) if source not in LOCAL_IMAGE_SOURCES]
    found = {source: trainer_images(render(source, root)) for source in sources}
    # Equality, so no placeholder (`ddp-deploy`, `ddp-deploy-cuda`) and no default (`ddp-deploy:cuda`) is left anywhere.
    assert found == {source: {f"{cpu}-cuda"} if source in GPU_SOURCES else {cpu} for source in sources}


# --- make push: both builds, under the tags make k8s-image derives --------------------------------------------
# Docker's CLI replaced by a script that answers `image inspect` for the images it is told exist (labelled with the
# commit, as `make image` labels them) and records every tag and push: what is pushed, not how a registry stores
# it (tests/deploy/test_docker.py pushes to a real registry).

FAKE_DOCKER = """#!/usr/bin/env bash
echo "$*" >> "$DOCKER_CALLS"
if [ "$1 $2" = "image inspect" ]; then
  image=${@: -1}
  case " $FAKE_IMAGES " in *" $image "*) ;; *) exit 1 ;; esac
  [ "$3" = --format ] && echo "$FAKE_REVISION"
fi
exit 0
"""


@pytest.fixture
def committed_checkout(tmp_path: Path) -> Path:
    """What `make push` reads (the Makefile, the scripts, pyproject's version) in a git checkout with nothing
    uncommitted, whatever the developer's tree holds."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copytree(REPO_ROOT / "scripts", checkout / "scripts")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO_ROOT / name, checkout / name)
    git = ["git", "-C", str(checkout), "-c", "user.name=test", "-c", "user.email=test@example.com"]
    for step in (["init", "--quiet"], ["add", "."], ["commit", "--quiet", "-m", "the pushed code"]):
        subprocess.run([*git, *step], check=True, capture_output=True, timeout=30)
    return checkout


def push_with_fake_docker(checkout: Path, tmp_path: Path, images: str,
                          revision: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """`make push REGISTRY=registry.example.com/team` where only ``images`` exist, labelled ``revision``; its result
    and the docker commands it ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    calls = tmp_path / "docker-calls"
    calls.touch()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DOCKER_CALLS": str(calls),
           "FAKE_IMAGES": images, "FAKE_REVISION": revision}
    pushed = subprocess.run(["make", "--no-print-directory", "-C", str(checkout), "push",
                             "REGISTRY=registry.example.com/team"], capture_output=True, text=True, env=env,
                            timeout=60, check=False)
    return pushed, calls.read_text().splitlines()


def test_make_push_pushes_the_cpu_image_and_its_cuda_build_under_the_same_tags(committed_checkout, tmp_path):
    head = subprocess.run(["git", "-C", str(committed_checkout), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    pushed, lines = push_with_fake_docker(committed_checkout, tmp_path, "ddp-deploy:latest ddp-deploy:cuda", head)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    version = next(line.split('"')[1] for line in (REPO_ROOT / "pyproject.toml").read_text().splitlines()
                   if line.startswith("version = "))
    target = "registry.example.com/team/ddp-deploy"
    tags = {f"{target}:{version}": "ddp-deploy:latest", f"{target}:sha-{head[:12]}": "ddp-deploy:latest",
            f"{target}:{version}-cuda": "ddp-deploy:cuda", f"{target}:sha-{head[:12]}-cuda": "ddp-deploy:cuda"}
    assert {line.split()[2]: line.split()[1] for line in lines if line.startswith("tag ")} == tags
    assert {line.split()[-1] for line in lines if line.startswith("push ")} == set(tags)
    # The hint names the commit's tag; make k8s-image derives the GPU overlays' from it, the one pushed above.
    assert pushed.stdout.splitlines()[-1].endswith(f"make k8s-image IMAGE={target}:sha-{head[:12]}")


def test_make_push_refuses_before_pushing_anything_when_the_cuda_build_is_missing(committed_checkout, tmp_path):
    pushed, lines = push_with_fake_docker(committed_checkout, tmp_path, "ddp-deploy:latest", "unused")
    assert pushed.returncode != 0
    assert ("error: no image ddp-deploy:cuda here: build the CUDA image (docs/containers.md), or push the CPU image "
            "alone with make push REGISTRY=registry.example.com/team CUDA_IMAGE=\n") in pushed.stderr
    assert not [line for line in lines if line.startswith(("tag ", "push "))]
