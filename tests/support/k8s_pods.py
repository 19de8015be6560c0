"""A pod of a PyTorchJob made concrete on this machine: its environment, its volumes and its user.

What the kubelet would do before the container starts, for tests without a cluster:

* a PersistentVolumeClaim is a folder shared by all pods, given to the pod's ``fsGroup``;
* a ConfigMap is its keys as files in a folder of the pod's own, mounted read-only;
* an emptyDir is a private folder, or a tmpfs of its ``sizeLimit`` with ``medium: Memory``;
* the environment is the container's own (values, ``$(NAME)`` references to the variables before them, this
  container's ``resourceFieldRef``, the pod's namespace and labels by ``fieldRef``) followed by what the
  training operator appends (tests/support/k8s_operator.py);
* the command is the container's command and args, with ``$(NAME)`` replaced by the variable's value;
* the security settings are the pod's, overridden by the container's, as the kubelet merges them.

tests/support/k8s_processes.py starts such pods as processes, tests/support/k8s_containers.py as Docker containers.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.k8s_operator import PodPlan

Obj = dict[str, Any]
QUANTITY_SUFFIXES = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9,
                     "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


@dataclass(frozen=True)
class Mount:
    target: Path
    source: Path | None  # None: a tmpfs of tmpfs_bytes
    read_only: bool = False
    tmpfs_bytes: int = 0


@dataclass(frozen=True)
class Pod:
    name: str
    image: str
    command: list[str]
    env: dict[str, str]
    mounts: list[Mount]
    security: Obj  # the pod's securityContext, overridden by the container's where both set a field
    aliases: tuple[str, ...] = ()  # other names of the pod's address: <name>.<subdomain>


@dataclass(frozen=True)
class PodResult:
    name: str
    returncode: int
    log: str


def prepare(plan: PodPlan, config_maps: dict[str, dict[str, str]], claims: dict[str, Path],
            pod_dir: Path) -> Pod:
    """Materialise the pod's volumes under pod_dir (and the claims' ownership); resolve its environment."""
    spec, container = plan.template["spec"], plan.container
    volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
    mounts = []
    for mount in container.get("volumeMounts", []):
        if "subPath" in mount:
            raise AssertionError(f"pod {plan.name}: subPath mounts are not emulated")
        mounts.append(_mount(volumes[mount["name"]], mount, config_maps, claims, pod_dir,
                             spec.get("securityContext", {})))
    env = environment(plan)
    command = pod_command(plan, env)
    security = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
    aliases = (f"{plan.name}.{plan.subdomain}",) if plan.subdomain else ()
    return Pod(plan.name, container["image"], command, env, mounts, security, aliases)


def pod_command(plan: PodPlan, env: dict[str, str] | None = None) -> list[str]:
    """The container's command and args as the kubelet runs them, in the pod's environment (by default, its own)."""
    env = environment(plan) if env is None else env
    return [_expanded(word, env) for word in [*plan.container.get("command", []), *plan.container.get("args", [])]]


def _expanded(word: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of a command's word or a variable's value (Kubernetes' third_party expand.go):
    $(NAME), NAME anything up to the next ')', is that variable (one not in ``env`` is left as written); $$ is $."""
    return re.sub(r"\$\$|\$\(([^)]*)\)",
                  lambda found: "$" if found.group(0) == "$$" else env.get(found.group(1), found.group(0)), word)


def _mount(volume: Obj, mount: Obj, config_maps: dict[str, dict[str, str]], claims: dict[str, Path],
           pod_dir: Path, pod_security: Obj) -> Mount:
    target, name = Path(mount["mountPath"]), volume["name"]
    if "persistentVolumeClaim" in volume:
        claim = volume["persistentVolumeClaim"]["claimName"]
        if claim not in claims:
            raise AssertionError(f"volume {name}: no folder given for PersistentVolumeClaim {claim!r}")
        if "fsGroup" in pod_security:
            # The kubelet gives the volume to the fsGroup, group-writable, new files inheriting the group.
            os.chown(claims[claim], -1, pod_security["fsGroup"])
            claims[claim].chmod(0o2775)
        return Mount(target, claims[claim], read_only=bool(mount.get("readOnly")))
    if "configMap" in volume:
        config_map = volume["configMap"]["name"]
        if config_map not in config_maps:
            raise AssertionError(f"volume {name}: ConfigMap {config_map!r} is not among the rendered objects")
        source = pod_dir / f"configmap-{name}"
        source.mkdir(mode=0o755)
        for key, text in config_maps[config_map].items():
            (source / key).write_text(text)
            (source / key).chmod(0o644)
        return Mount(target, source, read_only=True)  # the kubelet mounts ConfigMaps read-only
    if "emptyDir" in volume:
        if volume["emptyDir"].get("medium") == "Memory":
            size = math.ceil(_quantity(volume["emptyDir"].get("sizeLimit", "64Mi")))
            return Mount(target, None, tmpfs_bytes=size)
        source = pod_dir / f"emptydir-{name}"
        source.mkdir()
        source.chmod(0o777)
        return Mount(target, source)
    raise AssertionError(f"volume {name}: only persistentVolumeClaim, configMap and emptyDir volumes "
                         f"are emulated")


def environment(plan: PodPlan) -> dict[str, str]:
    """The container's environment as the kubelet gives it, then the operator's variables."""
    container, env = plan.container, {}
    metadata = {"metadata.namespace": plan.namespace, "metadata.name": plan.name,
                **{f"metadata.labels['{key}']": value for key, value in plan.labels}}
    for entry in container.get("env", []):
        if _absent_optional_key(entry):
            continue
        env[entry["name"]] = _env_value(entry, container, plan.name, metadata, env)
    env.update(plan.operator_env)
    return env


def _absent_optional_key(entry: Obj) -> bool:
    """A variable from an optional key of a Secret or ConfigMap: no Secrets are emulated, and the kubelet leaves such
    a variable unset where the Secret is absent (a namespace that has none: the pods get access another way)."""
    source = entry.get("valueFrom", {})
    return any(source.get(ref, {}).get("optional") is True for ref in ("secretKeyRef", "configMapKeyRef"))


def _env_value(entry: Obj, container: Obj, pod_name: str, metadata: dict[str, str], before: dict[str, str]) -> str:
    if "value" in entry:
        return _expanded(str(entry["value"]), before)  # only the variables defined before this one
    field_ref = entry.get("valueFrom", {}).get("fieldRef")
    if field_ref is not None:
        if field_ref["fieldPath"] not in metadata:
            raise AssertionError(f"pod {pod_name}: env {entry['name']}: fieldRef {field_ref['fieldPath']} is not "
                                 f"one the pod has (only its namespace, name and labels are emulated)")
        return metadata[field_ref["fieldPath"]]
    field = entry.get("valueFrom", {}).get("resourceFieldRef")
    if field is None or field.get("containerName", container["name"]) != container["name"]:
        raise AssertionError(f"pod {pod_name}: env {entry['name']}: only values, fieldRef and this container's "
                             f"resourceFieldRef are emulated")
    kind, resource = field["resource"].split(".", 1)
    quantity = container.get("resources", {}).get(kind, {}).get(resource)
    if quantity is None:
        raise AssertionError(f"pod {pod_name}: env {entry['name']} refers to {field['resource']}, "
                             f"which the container does not set")
    # The kubelet rounds up to a whole number of divisors.
    return str(math.ceil(_quantity(quantity) / _quantity(field.get("divisor", "1"))))


def _quantity(value: str | int | float) -> float:
    text = str(value)
    for suffix in sorted(QUANTITY_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * QUANTITY_SUFFIXES[suffix]
    return float(text)
