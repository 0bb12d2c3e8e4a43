"""Every setting of the rig, declared once: its default, the environment variable that overrides
it, and the help `rig.py --help` prints. Addresses are used only inside the network namespace the
rig creates, plus the host end of its veth and two host routes (pods and Services via the node)."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    env: str
    default: str
    help: str


SETTINGS = (
    Setting("state", "DISAGG_NODE_STATE", "~/.cache/disagg-node",
            "state folder: images, containerd, kubelet, control plane, logs, kubeconfig, rig.json"),
    Setting("k8s_bin", "K8S_BIN", "~/k8s-bin",
            "folder with kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy (v1.36)"),
    Setting("netns", "DISAGG_NODE_NETNS", "dg-node",
            "network namespace of containerd, the kubelet, kube-proxy, DNS and the pods"),
    Setting("node_name", "DISAGG_NODE_NAME", "dg-node", "the Node's name"),
    Setting("host_veth", "DISAGG_NODE_HOST_VETH", "dg-h", "host end of the veth pair"),
    Setting("node_veth", "DISAGG_NODE_NODE_VETH", "dg-n", "namespace end of the veth pair"),
    Setting("link_cidr", "DISAGG_NODE_LINK_CIDR", "10.213.0.0/30",
            "veth link: the host takes its first address (API relay), the node its second"),
    Setting("pod_cidr", "DISAGG_NODE_POD_CIDR", "10.214.0.0/24", "pod addresses (bridge CNI)"),
    Setting("service_cidr", "DISAGG_NODE_SERVICE_CIDR", "10.0.0.0/24",
            "Service ClusterIPs (the API server's --service-cluster-ip-range)"),
    Setting("bridge", "DISAGG_NODE_BRIDGE", "dgbr0", "the pods' bridge inside the namespace"),
    Setting("cgroup_root", "DISAGG_NODE_CGROUP", "dg", "cgroup subtree of the kubelet and its pods"),
    Setting("cluster_domain", "DISAGG_NODE_DOMAIN", "cluster.local", "cluster DNS domain"),
    Setting("api_port", "DISAGG_NODE_API_PORT", "16543",
            "kube-apiserver port (127.0.0.1; relayed on the host's link address)"),
    Setting("etcd_port", "DISAGG_NODE_ETCD_PORT", "23890", "etcd client port (127.0.0.1)"),
    Setting("etcd_peer_port", "DISAGG_NODE_ETCD_PEER_PORT", "23891", "etcd peer port (127.0.0.1)"),
    Setting("kcm_port", "DISAGG_NODE_KCM_PORT", "10357", "kube-controller-manager port (127.0.0.1)"),
    Setting("scheduler_port", "DISAGG_NODE_SCHEDULER_PORT", "10359", "kube-scheduler port (127.0.0.1)"),
    Setting("torch_index", "DISAGG_NODE_TORCH_INDEX", "",
            "TORCH_INDEX build argument of the CPU worker image; empty: the host pip's first local "
            "index (file://) if it has one, else the Dockerfile's default"),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Config:
    state: Path
    k8s_bin: Path
    netns: str
    node_name: str
    host_veth: str
    node_veth: str
    link_cidr: str
    pod_cidr: str
    service_cidr: str
    bridge: str
    cgroup_root: str
    cluster_domain: str
    api_port: int
    etcd_port: int
    etcd_peer_port: int
    kcm_port: int
    scheduler_port: int
    torch_index: str

    @property
    def host_ip(self) -> str:
        return str(ipaddress.ip_network(self.link_cidr)[1])

    @property
    def node_ip(self) -> str:
        return str(ipaddress.ip_network(self.link_cidr)[2])

    @property
    def link_prefix(self) -> int:
        return ipaddress.ip_network(self.link_cidr).prefixlen

    @property
    def pod_gateway(self) -> str:
        return str(ipaddress.ip_network(self.pod_cidr)[1])

    @property
    def kubernetes_service_ip(self) -> str:
        """The `kubernetes` Service's ClusterIP: the range's first address."""
        return str(ipaddress.ip_network(self.service_cidr)[1])

    @property
    def dns_ip(self) -> str:
        """dnsmasq listens on the node's address; the kubelet gives it to pods as their resolver."""
        return self.node_ip

    @property
    def netns_path(self) -> str:
        return f"/var/run/netns/{self.netns}"


def _convert(name: str, value: str):
    kind = Config.__dataclass_fields__[name].type
    if kind == "Path":
        return Path(os.path.expanduser(value))
    if kind == "int":
        return int(value)
    return value


def load(environ: dict[str, str] | None = None, overrides: dict[str, str] | None = None) -> Config:
    """Defaults, then the environment, then explicit overrides (command-line options)."""
    environ = os.environ if environ is None else environ
    overrides = overrides or {}
    values = {}
    for s in SETTINGS:
        raw = overrides.get(s.name)
        if raw is None:
            raw = environ.get(s.env, s.default)
        values[s.name] = _convert(s.name, raw)
    config = Config(**values)
    check(config)
    return config


def check(config: Config) -> None:
    link = ipaddress.ip_network(config.link_cidr)
    if link.num_addresses < 4:
        raise ValueError(f"link_cidr {config.link_cidr}: needs two host addresses (a /30 or wider)")
    nets = {
        "link_cidr": link,
        "pod_cidr": ipaddress.ip_network(config.pod_cidr),
        "service_cidr": ipaddress.ip_network(config.service_cidr),
    }
    names = list(nets)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if nets[a].overlaps(nets[b]):
                raise ValueError(f"{a} {nets[a]} overlaps {b} {nets[b]}")
