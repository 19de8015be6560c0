"""The Pod Security Standards' restricted and baseline profiles, checked on a pod spec offline.

No maintained checker installs here (pod-security-admission is Go, inside the API server), so each rule below is
the profile's documented rule, named by the check's ID in kubernetes/kubernetes
staging/src/k8s.io/pod-security-admission/policy/ (the file is check_<ID>.go) and by the row of the Pod Security
Standards page (kubernetes.io/docs/concepts/security/pod-security-standards/). Restricted includes baseline: the
baseline rules that a training pod could break are checked too. Baseline alone (BASELINE) is for the pods that
restricted refuses: which level a namespace needs for them (``strictest_profile``). Its appArmorProfile check is left
out: no pod here names an AppArmor profile. Init containers count like containers (the admission's visitContainers
walks both, and ephemeral containers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

Obj = dict[str, Any]
Rule = Callable[[Obj], list[str]]

# restrictedVolumes: "Volume Types" (restricted) allows only these sources; hostPath (baseline) is among the refused.
ALLOWED_VOLUME_SOURCES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                    "persistentVolumeClaim", "projected", "secret"})
# seccompProfile_restricted: "Seccomp (v1.19+)".
ALLOWED_SECCOMP = frozenset({"RuntimeDefault", "Localhost"})
# capabilities_baseline: "Capabilities" (baseline), the capabilities a container may add beyond the runtime's
# defaults. IPC_LOCK, which RDMA examples add, is not among them.
BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                   "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
# sysctls: "Sysctls" (baseline), the safe set.
SAFE_SYSCTLS = frozenset({"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies",
                          "net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start",
                          "net.ipv4.ip_local_reserved_ports", "net.ipv4.tcp_keepalive_time",
                          "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                          "net.ipv4.tcp_keepalive_probes"})


def containers(pod: Obj) -> Iterator[Obj]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from pod.get(key) or []


def _security(container: Obj) -> Obj:
    return container.get("securityContext") or {}


def allow_privilege_escalation(pod: Obj) -> list[str]:
    """allowPrivilegeEscalation ("Privilege Escalation (v1.8+)"): every container sets it to false, explicitly."""
    return [f"container {c['name']!r} must set securityContext.allowPrivilegeEscalation=false"
            for c in containers(pod) if _security(c).get("allowPrivilegeEscalation") is not False]


def capabilities_restricted(pod: Obj) -> list[str]:
    """capabilities_restricted ("Capabilities (v1.22+)"): every container drops ALL and adds at most
    NET_BIND_SERVICE."""
    errors = []
    for c in containers(pod):
        capabilities = _security(c).get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            errors.append(f"container {c['name']!r} must set securityContext.capabilities.drop=['ALL']")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            errors.append(f"container {c['name']!r} must not add {capabilities['add']}")
    return errors


def run_as_non_root(pod: Obj) -> list[str]:
    """runAsNonRoot ("Running as Non-root"): true on the pod, or on every container; false nowhere."""
    pod_level = (pod.get("securityContext") or {}).get("runAsNonRoot")
    errors = ["the pod must not set runAsNonRoot=false"] if pod_level is False else []
    for c in containers(pod):
        own = _security(c).get("runAsNonRoot")
        if own is False or (own is None and pod_level is not True):
            errors.append(f"pod or container {c['name']!r} must set securityContext.runAsNonRoot=true")
    return errors


def run_as_user(pod: Obj) -> list[str]:
    """runAsUser ("Running as Non-root user (v1.23+)"): never 0, on the pod or a container."""
    settings = [("the pod", pod.get("securityContext") or {})]
    settings += [(f"container {c['name']!r}", _security(c)) for c in containers(pod)]
    return [f"{who} must not set runAsUser=0" for who, security in settings if security.get("runAsUser") == 0]


def seccomp_profile_restricted(pod: Obj) -> list[str]:
    """seccompProfile_restricted ("Seccomp (v1.19+)"): RuntimeDefault or Localhost on the pod, or on every
    container; nothing else anywhere."""
    pod_type = ((pod.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
    errors = [f"the pod must not set seccompProfile.type={pod_type}"] if pod_type and pod_type not in ALLOWED_SECCOMP \
        else []
    for c in containers(pod):
        own = (_security(c).get("seccompProfile") or {}).get("type")
        if (own is not None and own not in ALLOWED_SECCOMP) or (own is None and pod_type not in ALLOWED_SECCOMP):
            errors.append(f"pod or container {c['name']!r} must set seccompProfile.type to RuntimeDefault or Localhost")
    return errors


def restricted_volumes(pod: Obj) -> list[str]:
    """restrictedVolumes ("Volume Types"), which also refuses hostPathVolumes' hostPath ("HostPath Volumes")."""
    return [f"volume {v['name']!r} has a restricted type: {sorted(set(v) - {'name'})}"
            for v in pod.get("volumes") or [] if not set(v) - {"name"} <= ALLOWED_VOLUME_SOURCES]


def privileged(pod: Obj) -> list[str]:
    """privileged ("Privileged Containers", baseline)."""
    return [f"container {c['name']!r} must not be privileged"
            for c in containers(pod) if _security(c).get("privileged")]


def host_namespaces(pod: Obj) -> list[str]:
    """hostNamespaces ("Host Namespaces", baseline)."""
    return [f"the pod must not set {key}" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]


def host_ports(pod: Obj) -> list[str]:
    """hostPorts ("Host Ports", baseline)."""
    return [f"container {c['name']!r} must not use hostPort {p['hostPort']}"
            for c in containers(pod) for p in c.get("ports") or [] if p.get("hostPort")]


def host_process(pod: Obj) -> list[str]:
    """windowsHostProcess ("HostProcess", baseline)."""
    settings = [pod.get("securityContext") or {}, *(_security(c) for c in containers(pod))]
    return ["no hostProcess container" for s in settings if (s.get("windowsOptions") or {}).get("hostProcess")]


def proc_mount(pod: Obj) -> list[str]:
    """procMount ("/proc Mount Type", baseline): Default only."""
    return [f"container {c['name']!r} must not set procMount={_security(c)['procMount']}"
            for c in containers(pod) if _security(c).get("procMount", "Default") != "Default"]


def se_linux_options(pod: Obj) -> list[str]:
    """seLinuxOptions ("SELinux", baseline): no user or role; a type only of the container_t family."""
    allowed_types = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
    settings = [pod.get("securityContext") or {}, *(_security(c) for c in containers(pod))]
    return [f"seLinuxOptions {options} are not allowed" for s in settings
            if (options := s.get("seLinuxOptions") or {})
            and (options.get("user") or options.get("role") or options.get("type", "") not in allowed_types)]


def sysctls(pod: Obj) -> list[str]:
    """sysctls ("Sysctls", baseline): the safe set only."""
    return [f"sysctl {s['name']} is not in the safe set"
            for s in (pod.get("securityContext") or {}).get("sysctls") or [] if s["name"] not in SAFE_SYSCTLS]


def capabilities_baseline(pod: Obj) -> list[str]:
    """capabilities_baseline ("Capabilities", baseline): no container adds a capability outside the fixed list."""
    return [f"container {c['name']!r} must not add {sorted(added)}" for c in containers(pod)
            if (added := set((_security(c).get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES)]


def host_path_volumes(pod: Obj) -> list[str]:
    """hostPathVolumes ("HostPath Volumes", baseline)."""
    return [f"volume {v['name']!r} must not be a hostPath" for v in pod.get("volumes") or [] if "hostPath" in v]


def seccomp_profile_baseline(pod: Obj) -> list[str]:
    """seccompProfile_baseline ("Seccomp", baseline): Unconfined nowhere; unset is allowed."""
    settings = [("the pod", pod.get("securityContext") or {})]
    settings += [(f"container {c['name']!r}", _security(c)) for c in containers(pod)]
    return [f"{who} must not set seccompProfile.type=Unconfined" for who, security in settings
            if (security.get("seccompProfile") or {}).get("type") == "Unconfined"]


RESTRICTED: dict[str, Rule] = {
    "allowPrivilegeEscalation": allow_privilege_escalation,
    "capabilities_restricted": capabilities_restricted,
    "runAsNonRoot": run_as_non_root,
    "runAsUser": run_as_user,
    "seccompProfile_restricted": seccomp_profile_restricted,
    "restrictedVolumes": restricted_volumes,
    "privileged": privileged,
    "hostNamespaces": host_namespaces,
    "hostPorts": host_ports,
    "windowsHostProcess": host_process,
    "procMount": proc_mount,
    "seLinuxOptions": se_linux_options,
    "sysctls": sysctls,
}


BASELINE: dict[str, Rule] = {
    "privileged": privileged,
    "hostNamespaces": host_namespaces,
    "hostPathVolumes": host_path_volumes,
    "hostPorts": host_ports,
    "windowsHostProcess": host_process,
    "procMount": proc_mount,
    "seLinuxOptions": se_linux_options,
    "sysctls": sysctls,
    "capabilities_baseline": capabilities_baseline,
    "seccompProfile_baseline": seccomp_profile_baseline,
}
# From the strictest; privileged (no checks) admits everything.
PROFILES: dict[str, dict[str, Rule]] = {"restricted": RESTRICTED, "baseline": BASELINE}


def violations(pod: Obj, profile: str) -> list[str]:
    """Why the profile refuses a pod spec, "check: detail" each; [] when it admits it."""
    return [f"{check}: {detail}" for check, rule in PROFILES[profile].items() for detail in rule(pod)]


def restricted_violations(pod: Obj) -> list[str]:
    """Why the restricted profile refuses a pod spec, "check: detail" each; [] when it admits it."""
    return violations(pod, "restricted")


def strictest_profile(pod: Obj) -> str:
    """The strictest level whose profile admits the pod spec: the level its namespace's pod-security.kubernetes.io/
    enforce label may have at most."""
    return next((profile for profile in PROFILES if not violations(pod, profile)), "privileged")
