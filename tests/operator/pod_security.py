"""The `restricted` Pod Security Standard, written from its definition
(kubernetes.io/docs/concepts/security/pod-security-standards): every baseline control plus the
restricted ones, and this project's own rule that every container's root file system is read-only.

`violations(pod_spec)` lists each broken control with the field that breaks it.
"""

from __future__ import annotations

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip
SECCOMP_OK = {"RuntimeDefault", "Localhost"}


def _containers(pod: dict):
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for container in pod.get(kind) or []:
            yield f"{kind}[{container['name']}]", container


def violations(pod: dict) -> list[str]:
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    # ---- baseline
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"spec.{field}")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("spec.securityContext.windowsOptions.hostProcess")
    for volume in pod.get("volumes") or []:
        if "hostPath" in volume:
            out.append(f"spec.volumes[{volume['name']}].hostPath")
    for sysctl in psc.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"spec.securityContext.sysctls[{sysctl['name']}]")
    for where, sc in [("spec.securityContext", psc)] + [
        (f"{w}.securityContext", c.get("securityContext") or {}) for w, c in _containers(pod)
    ]:
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            out.append(f"{where}.seLinuxOptions")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{where}.seccompProfile")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            out.append(f"{where}.appArmorProfile")
    for where, container in _containers(pod):
        sc = container.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{where}.securityContext.privileged")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{where}.securityContext.windowsOptions.hostProcess")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{where}.securityContext.procMount")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{where}.ports[{port.get('name')}].hostPort")
        # ---- restricted
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}.securityContext.capabilities.drop")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}.securityContext.capabilities.add")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}.securityContext.allowPrivilegeEscalation")
        if not (
            sc.get("runAsNonRoot") is True
            or (psc.get("runAsNonRoot") is True and sc.get("runAsNonRoot") is not False)
        ):
            out.append(f"{where}.securityContext.runAsNonRoot")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}.securityContext.runAsUser")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in SECCOMP_OK:
            out.append(f"{where}.securityContext.seccompProfile")
        # ---- this project
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{where}.securityContext.readOnlyRootFilesystem")
    if psc.get("runAsUser") == 0:
        out.append("spec.securityContext.runAsUser")
    for volume in pod.get("volumes") or []:
        kind = next(k for k in volume if k != "name")
        if kind not in RESTRICTED_VOLUMES:
            out.append(f"spec.volumes[{volume['name']}].{kind}")
    return sorted(set(out))


def pod_specs(manifests: list[dict]) -> dict[str, dict]:
    """`Kind/name` -> pod spec of every workload among `manifests`."""
    out = {}
    for m in manifests:
        if m["kind"] in ("StatefulSet", "Deployment", "Job", "DaemonSet", "ReplicaSet"):
            out[f"{m['kind']}/{m['metadata']['name']}"] = m["spec"]["template"]["spec"]
        elif m["kind"] == "LeaderWorkerSet":
            for part in ("leaderTemplate", "workerTemplate"):
                template = m["spec"]["leaderWorkerTemplate"][part]
                out[f"{m['kind']}/{m['metadata']['name']}/{part}"] = template["spec"]
        elif m["kind"] == "Pod":
            out[f"Pod/{m['metadata']['name']}"] = m["spec"]
    return out
