"""Pods (tests/support/k8s_pods.py) run as processes on this machine, each in mount and UTS namespaces of its own.

Needs root (unshare), as CI has. In each pod:

* the host name is the pod's name, and a private /etc/hosts maps each pod's name (and ``<name>.<subdomain>``)
  to that pod's own loopback address (127.0.1.N), as the headless Service of each replica does in a cluster;
* the volumes appear at their mount paths; a mount point that does not exist is made inside a private
  overlay of its parent folder, so nothing changes on this machine;
* ``readOnlyRootFilesystem`` makes / read-only; ``runAsUser``, ``runAsGroup`` and ``fsGroup`` become the
  process's ids; ``allowPrivilegeEscalation: false`` sets no_new_privs, and no capability is left but
  reading any file (see ``_exec``);
* the command is found on PATH: the given bin folder (the venv, where the image has /opt/venv/bin),
  then the system's;
* what stands in for the image (this checkout, its venv and the Python installation) stays visible at
  its own path, read-only, when a volume is mounted over a folder that holds it: a clone under /tmp
  would otherwise vanish under the pod's /tmp emptyDir.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from devtools.processes import kill_tree
from tests.support.k8s_pods import Pod, PodResult

SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
REPO_ROOT = Path(__file__).resolve().parents[2]


def image_paths() -> list[Path]:
    """The folders the pod's command runs from: the checkout (installed editable), the venv, Python itself."""
    folders = {Path(folder) for folder in (REPO_ROOT, sys.prefix, sys.base_prefix)}
    return sorted(folders | {folder.resolve() for folder in folders})


@dataclass(frozen=True)
class PodLoss:
    """A pod lost while the job runs (its node gone): every process of it killed at once, as soon as ``when``
    holds for the log of the pod ``seen_in``."""

    pod: str
    seen_in: str
    when: Callable[[str], bool]


def run_processes(pods: list[Pod], workdir: Path, bin_dir: Path, timeout_s: float,
                  loss: PodLoss | None = None) -> list[PodResult]:
    """Start every pod at once, as the operator does, and wait until all of them have exited (one of them lost
    on the way, where ``loss`` says so)."""
    hosts = workdir / "hosts"
    hosts.write_text("127.0.0.1\tlocalhost\n"
                     + "".join(f"127.0.1.{number}\t{' '.join((pod.name, *pod.aliases))}\n"
                               for number, pod in enumerate(pods, start=1)))
    hosts.chmod(0o644)
    started = []
    for pod in pods:
        layers = workdir / f"{pod.name}-overlays"
        script = "\n".join(shlex.join(line) for line in _script(pod, hosts, layers, bin_dir))
        log = workdir / f"{pod.name}.log"
        with log.open("w") as out:
            started.append((pod, log, subprocess.Popen(
                ["unshare", "--mount", "--uts", "--propagation", "private", "--", "sh", "-c", script],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)))
    deadline = time.monotonic() + timeout_s
    logs = {pod.name: log for pod, log, _ in started}
    try:
        while any(process.poll() is None for _, _, process in started):
            if loss is not None and loss.when(logs[loss.seen_in].read_text(errors="replace")):
                (lost,) = [process for pod, _, process in started if pod.name == loss.pod]
                kill_tree(lost.pid)  # torchrun's workers are in sessions of their own: not in the pod's group
                loss = None
            if time.monotonic() > deadline:
                running = [pod.name for pod, _, process in started if process.poll() is None]
                tails = "\n".join(f"--- {p.name}\n{log.read_text()[-3000:]}" for p, log, _ in started)
                raise AssertionError(f"pods {running} still running after {timeout_s} s:\n{tails}")
            time.sleep(0.2)
    finally:
        for _, _, process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return [PodResult(pod.name, process.returncode, log.read_text()) for pod, log, process in started]


def _script(pod: Pod, hosts: Path, layers: Path, bin_dir: Path) -> list[list[str]]:
    overlaid, lines = _mount_points([mount.target for mount in pod.mounts], layers)
    lines = [["set", "-eu"], ["hostname", pod.name], *lines, ["mount", "--bind", str(hosts), "/etc/hosts"]]
    for index, mount in enumerate(pod.mounts):
        under = [path for path in image_paths() if path.is_relative_to(mount.target)]
        hidden = [path for path in under if not any(path != other and path.is_relative_to(other) for other in under)]
        # A volume that would hide part of the image is mounted aside first, given the image's folders
        # at their places inside it, then moved over its target with them.
        where = layers / f"aside-{index}" if hidden else mount.target
        if hidden:
            where.mkdir(parents=True)
        if mount.source is None:
            lines.append(["mount", "-t", "tmpfs", "-o", f"size={mount.tmpfs_bytes},mode=1777", "tmpfs", str(where)])
        else:
            lines.append(["mount", "--bind", str(mount.source), str(where)])
        for path in hidden:
            inside = where / path.relative_to(mount.target)
            lines += [["mkdir", "-p", str(inside)], ["mount", "--bind", str(path), str(inside)],
                      ["mount", "-o", "remount,bind,ro", str(inside)]]
        if mount.read_only:
            lines.append(["mount", "-o", "remount,bind,ro", str(where)])
        if hidden:
            lines.append(["mount", "--move", str(where), str(mount.target)])
    if pod.security.get("readOnlyRootFilesystem"):
        # Last: a bind mount made from a read-only mount would be read-only too.
        lines += [["mount", "-o", "remount,bind,ro", str(path)] for path in [Path("/"), *overlaid]]
    return [*lines, _exec(pod, bin_dir)]


def _mount_points(paths: list[Path], layers: Path) -> tuple[list[Path], list[list[str]]]:
    """Make missing mount points inside private overlays of their nearest existing parent folder."""
    lines: list[list[str]] = []
    overlaid: list[Path] = []
    for path in paths:
        if path.exists():
            continue
        parent = next(p for p in path.parents if p.exists())
        if parent == Path("/"):
            raise AssertionError(f"mount path {path}: mount points are made only below an existing folder "
                                 f"other than /")
        if parent not in overlaid:
            upper, work = layers / str(len(overlaid)) / "upper", layers / str(len(overlaid)) / "work"
            upper.mkdir(parents=True)
            work.mkdir()
            options = f"lowerdir={parent},upperdir={upper},workdir={work}"
            lines.append(["mount", "-t", "overlay", "overlay", "-o", options, str(parent)])
            overlaid.append(parent)
        lines.append(["mkdir", "-p", str(path)])
    return overlaid, lines


def _exec(pod: Pod, bin_dir: Path) -> list[str]:
    security = pod.security
    ids = [f"--reuid={security['runAsUser']}"] if "runAsUser" in security else []
    ids += [f"--regid={security['runAsGroup']}"] if "runAsGroup" in security else []
    ids += [f"--groups={security['fsGroup']}"] if "fsGroup" in security else ["--clear-groups"]
    if security.get("allowPrivilegeEscalation") is False:
        ids.append("--no-new-privs")
    # No capability but one, reading and searching any folder: this machine's Python lives under /root
    # (mode 0700), where the image has /opt/venv. Writes are still checked as the pod's user.
    ids += ["--inh-caps=-all,+dac_read_search", "--ambient-caps=+dac_read_search",
            "--bounding-set=-all,+dac_read_search"]
    env = {"PATH": f"{bin_dir}:{SYSTEM_PATH}", "HOSTNAME": pod.name, **pod.env}
    return ["exec", "setpriv", *ids, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()), *pod.command]
