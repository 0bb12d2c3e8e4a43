"""The node: containerd, the kubelet, kube-proxy and dnsmasq inside the network namespace, the API
relay on the host, and the checks that each one works (the Node Ready, a Service reached from the
host through kube-proxy's rules, a cluster name resolved by the node's DNS)."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from . import (
    cgroups,
    cni_config,
    containerd_config,
    dnsquery,
    dnssync,
    host,
    kubelet_config,
    objects,
    proc,
    proxy_config,
)
from .api import Api
from .layout import Layout
from .settings import Config

RIG_SCRIPT = Path(__file__).resolve().parent / "rig.py"


def ctr(layout: Layout, *args: str) -> list[str]:
    return ["ctr", "-a", str(layout.containerd_socket), "-n", "k8s.io", *args]


# ---- containerd ---------------------------------------------------------------------------------


def start_containerd(cfg: Config, layout: Layout, sandbox_image: str) -> None:
    for d in (layout.containerd_root, layout.containerd_state, layout.cni_conf_dir, layout.cni_ipam_dir):
        d.mkdir(parents=True, exist_ok=True)
    layout.containerd_config.write_text(containerd_config.render(layout, sandbox_image))
    (layout.cni_conf_dir / cni_config.FILE_NAME).write_text(cni_config.render(cfg, layout))
    proc.start(
        layout,
        "containerd",
        proc.in_netns(cfg.netns, ["containerd", "--config", str(layout.containerd_config)]),
    )
    proc.wait_for(
        lambda: proc.must_live(layout, "containerd") and proc.run(ctr(layout, "version"), check=False).returncode == 0,
        60, "containerd answering",
    )  # fmt: skip


def containerd_tasks(layout: Layout) -> list[str]:
    done = proc.run(ctr(layout, "tasks", "ls", "-q"), check=False)
    return done.stdout.decode().split() if done.returncode == 0 else []


def image_refs(layout: Layout) -> set[str]:
    done = proc.run(ctr(layout, "images", "ls", "-q"), check=False)
    return set(done.stdout.decode().split()) if done.returncode == 0 else set()


def tag(layout: Layout, source: str, target: str) -> None:
    proc.run(ctr(layout, "images", "tag", "--force", source, target))


def remove_containers(layout: Layout) -> int:
    """Kills and deletes every task and container containerd holds (what is left of pods)."""
    for task in containerd_tasks(layout):
        proc.run(ctr(layout, "tasks", "kill", "--signal", "SIGKILL", task), check=False)
    deadline = time.monotonic() + 10
    while containerd_tasks(layout) and time.monotonic() < deadline:
        for task in containerd_tasks(layout):
            proc.run(ctr(layout, "tasks", "delete", "--force", task), check=False)
        time.sleep(0.2)
    done = proc.run(ctr(layout, "containers", "ls", "-q"), check=False)
    containers = done.stdout.decode().split() if done.returncode == 0 else []
    for c in containers:
        proc.run(ctr(layout, "containers", "delete", c), check=False)
    return len(containers)


def remove_runc_leftovers(layout: Layout) -> int:
    """Containers runc still runs after containerd is gone (their shims killed by hand)."""
    root = layout.runc_root / "k8s.io"
    if not root.is_dir():
        return 0
    done = proc.run(["runc", "--root", str(root), "list", "-q"], check=False)
    ids = done.stdout.decode().split() if done.returncode == 0 else []
    for cid in ids:
        proc.run(["runc", "--root", str(root), "kill", cid, "KILL"], check=False)
        proc.run(["runc", "--root", str(root), "delete", "--force", cid], check=False)
    return len(ids)


def shim_pids(layout: Layout) -> list[int]:
    """containerd-shim-runc-v2 processes serving this rig's containerd (named by its socket)."""
    address = str(layout.containerd_socket)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and address.encode() in argv:
            found.append(int(entry))
    return found


CNI_CACHE = Path("/var/lib/cni/results")  # the CNI library's, fixed: containerd 1.6 has no setting for it


def remove_cni_cache() -> int:
    """Cached CNI results of the rig's pods that died without a CNI DEL (containerd or the kubelet
    killed): its network's entries and the loopback entries of the same containers."""
    if not CNI_CACHE.is_dir():
        return 0
    prefix = cni_config.NETWORK_NAME + "-"
    ids = {p.name[len(prefix) :].rsplit("-", 1)[0] for p in CNI_CACHE.glob(prefix + "*")}
    gone = 0
    for path in CNI_CACHE.iterdir():
        if path.name.startswith(prefix) or any(path.name == f"cni-loopback-{cid}-lo" for cid in ids):
            path.unlink()
            gone += 1
    return gone


# ---- the API relay and the `kubernetes` Service -------------------------------------------------


def start_relay(cfg: Config, layout: Layout) -> None:
    listen = f"TCP-LISTEN:{cfg.api_port},bind={cfg.host_ip},fork,reuseaddr"
    proc.start(layout, "api-relay", ["socat", listen, f"TCP:127.0.0.1:{cfg.api_port}"])
    proc.wait_for(lambda: proc.must_live(layout, "api-relay") and _connects(cfg.host_ip, cfg.api_port),
                  10, "API relay listening")  # fmt: skip


def _connects(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1):
            return True
    except OSError:
        return False


def publish_api_endpoint(cfg: Config, api: Api) -> None:
    api.apply("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices", "kubernetes",
              objects.kubernetes_endpointslice(cfg))  # fmt: skip


# ---- kubelet --------------------------------------------------------------------------------------


def start_kubelet(cfg: Config, layout: Layout) -> None:
    cgroups.create(cfg.cgroup_root)
    for d in (layout.kubelet_root, layout.pod_logs):
        d.mkdir(parents=True, exist_ok=True)
    layout.resolv_conf.write_text(f"nameserver {cfg.dns_ip}\n")
    layout.kubelet_config.write_text(kubelet_config.render(cfg, layout, str(layout.pki)))
    argv = kubelet_config.args(cfg, layout, str(cfg.k8s_bin / "kubelet"))
    proc.start(layout, "kubelet", proc.in_netns(cfg.netns, argv))


def node_ready(api: Api, name: str) -> bool:
    try:
        node = api.get(f"/api/v1/nodes/{name}")
    except Exception:  # noqa: BLE001 - not registered yet
        return False
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))


def wait_node_ready(cfg: Config, layout: Layout, api: Api, saved_sysctls: dict[str, str]) -> list[str]:
    proc.wait_for(
        lambda: proc.must_live(layout, "kubelet") and node_ready(api, cfg.node_name), 120, "Node Ready"
    )
    # the kubelet rewrote machine-wide sysctls while starting: put them back
    return host.restore_sysctls(saved_sysctls)


# ---- kube-proxy -----------------------------------------------------------------------------------


def start_proxy(cfg: Config, layout: Layout) -> None:
    layout.proxy_config.write_text(proxy_config.render(cfg, layout))
    proc.start(
        layout,
        "kube-proxy",
        proc.in_netns(cfg.netns, proxy_config.args(layout, str(cfg.k8s_bin / "kube-proxy"))),
    )


def wait_service_path(cfg: Config, layout: Layout) -> None:
    """The `kubernetes` Service's ClusterIP, from the host: host route -> the node -> kube-proxy's
    DNAT -> the relay -> the API server."""
    through = Api(f"https://{cfg.kubernetes_service_ip}:443", str(layout.pki / "ca.crt"),
                  (layout.pki / "admin.token").read_text().strip())  # fmt: skip
    proc.wait_for(lambda: proc.must_live(layout, "kube-proxy") and through.ready(), 60,
                  f"the API through the kubernetes Service ({cfg.kubernetes_service_ip}:443)")  # fmt: skip


# ---- DNS --------------------------------------------------------------------------------------------


def dnsmasq_args(cfg: Config, layout: Layout) -> list[str]:
    return [
        "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
        f"--addn-hosts={layout.dns_hosts}", f"--listen-address={cfg.dns_ip}", "--bind-interfaces",
        f"--local=/{cfg.cluster_domain}/", "--domain-needed", "--user=root", "--log-facility=-",
        f"--pid-file={layout.dnsmasq_pid}",
    ]  # fmt: skip


def start_dns(cfg: Config, layout: Layout, api: Api, rig_options: list[str]) -> None:
    dnssync.write_if_changed(layout.dns_hosts, dnssync.render(api, cfg))
    proc.start(layout, "dnsmasq", proc.in_netns(cfg.netns, dnsmasq_args(cfg, layout)))
    proc.start(layout, "dns-sync", [sys.executable, str(RIG_SCRIPT), *rig_options, "dns-sync"])
    name = f"kubernetes.default.svc.{cfg.cluster_domain}"
    proc.wait_for(
        lambda: proc.must_live(layout, "dnsmasq") and proc.must_live(layout, "dns-sync")
        and resolve(cfg.dns_ip, name) == [cfg.kubernetes_service_ip],
        30, f"DNS answering {name}",
    )  # fmt: skip


def resolve(server: str, name: str, timeout: float = 1.0) -> list[str]:
    ident = int.from_bytes(os.urandom(2), "big")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(dnsquery.query(name, ident), (server, 53))
        data, _ = s.recvfrom(4096)
    return dnsquery.answer(data, ident)[1]


NODE_PROCESSES = ("dns-sync", "dnsmasq", "kube-proxy", "kubelet")
