"""The Pod Security Standards' "restricted" profile (Kubernetes 1.30, the `latest` policy
version; https://kubernetes.io/docs/concepts/security/pod-security-standards/) as a checker
over a pod spec: every baseline control and every restricted one, each violation a line."""

from __future__ import annotations

from typing import Any

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                 "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t",
                 "container_engine_t"}


def violations(pod: dict[str, Any]) -> list[str]:
    """What in `pod` (a PodSpec) the restricted profile forbids; [] when it complies."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    containers = [*pod.get("initContainers", []), *pod.get("containers", []),
                  *pod.get("ephemeralContainers", [])]
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"{key}")
    for v in pod.get("volumes", []):
        kinds = [k for k in v if k != "name"]
        if any(k not in RESTRICTED_VOLUMES for k in kinds):
            out.append(f"volume {v['name']}: {kinds}")
    for s in psc.get("sysctls") or []:
        if s["name"] not in SAFE_SYSCTLS:
            out.append(f"sysctl {s['name']}")
    if psc.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    for where, sc in [("pod", psc)] + [(c["name"], c.get("securityContext") or {})
                                       for c in containers]:
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{where}: seLinuxOptions")
        app = (sc.get("appArmorProfile") or {}).get("type")
        if app not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{where}: appArmorProfile {app}")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{where}: hostProcess")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"pod seccompProfile {pod_seccomp}")
    for c in containers:
        name, sc = c["name"], c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities.drop lacks ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities.add {caps['add']}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp}")
        for p in c.get("ports", []):
            if p.get("hostPort"):
                out.append(f"{name}: hostPort {p['hostPort']}")
    return out
