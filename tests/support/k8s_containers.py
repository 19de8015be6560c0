"""Pods (tests/support/k8s_pods.py) run as Docker containers of the job's image, on a network of their own.

Each container is reachable under its pod's name (a network alias, as the replica's headless Service
makes it in a cluster) and has it as host name; its user, read-only root, capabilities and
no_new_privs come from the pod's securityContext.
"""

from __future__ import annotations

import subprocess
import time
import uuid

from tests.support.k8s_pods import Pod, PodResult


def docker(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s, check=False)


def image_present(image: str) -> bool:
    return docker("image", "inspect", image).returncode == 0


def run_containers(pods: list[Pod], timeout_s: float) -> list[PodResult]:
    """Start every pod at once, as the operator does, and wait until all of them have exited."""
    network = f"ddp-k8s-{uuid.uuid4().hex[:8]}"
    names = [f"{network}-{pod.name}" for pod in pods]
    _check(docker("network", "create", network))
    try:
        for pod, name in zip(pods, names, strict=True):
            _check(docker("run", "--detach", "--name", name, "--hostname", pod.name, "--network", network,
                          "--network-alias", pod.name, *_options(pod), pod.image, *pod.command))
        deadline = time.monotonic() + timeout_s
        codes = []
        for pod, name in zip(pods, names, strict=True):
            try:
                waited = docker("wait", name, timeout_s=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                tails = "\n".join(f"--- {n}\n{_logs(n)[-3000:]}" for n in names)
                raise AssertionError(f"pod {pod.name} still running after {timeout_s} s:\n{tails}") from None
            codes.append(int(_check(waited).stdout))
        return [PodResult(pod.name, code, _logs(name))
                for pod, name, code in zip(pods, names, codes, strict=True)]
    finally:
        docker("rm", "--force", *names)
        docker("network", "rm", network)


def _options(pod: Pod) -> list[str]:
    security = pod.security
    options = [f"--env={name}={value}" for name, value in pod.env.items()]
    if "runAsUser" in security:
        options.append(f"--user={security['runAsUser']}:{security.get('runAsGroup', security['runAsUser'])}")
    if "fsGroup" in security:
        options.append(f"--group-add={security['fsGroup']}")
    if security.get("readOnlyRootFilesystem"):
        options.append("--read-only")
    if security.get("allowPrivilegeEscalation") is False:
        options.append("--security-opt=no-new-privileges")
    options += [f"--cap-drop={cap}" for cap in security.get("capabilities", {}).get("drop", [])]
    for mount in pod.mounts:
        if mount.source is None:
            options.append(f"--mount=type=tmpfs,destination={mount.target},tmpfs-size={mount.tmpfs_bytes},"
                           f"tmpfs-mode=1777")
        else:
            options.append(f"--mount=type=bind,source={mount.source},destination={mount.target}"
                           + (",readonly" if mount.read_only else ""))
    return options


def _logs(name: str) -> str:
    out = docker("logs", name)
    return out.stdout + out.stderr


def _check(out: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(out.args)} failed: {out.stderr.strip()}")
    return out
