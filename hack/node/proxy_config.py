"""kube-proxy's configuration: iptables mode inside the node's namespace, node ports on the node's
address only, and no conntrack sysctl (those are machine-wide). Pure."""

from __future__ import annotations

import json

from .layout import Layout
from .settings import Config


def config(cfg: Config, layout: Layout) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "hostnameOverride": cfg.node_name,
        "clusterCIDR": cfg.pod_cidr,
        "bindAddress": cfg.node_ip,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [f"{cfg.node_ip}/32"],
        "clientConnection": {"kubeconfig": str(layout.kubeconfig_of("kube-proxy"))},
        # zero: leave nf_conntrack_max and the TCP timeouts (not per namespace) as they are
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def render(cfg: Config, layout: Layout) -> str:
    return json.dumps(config(cfg, layout), indent=2) + "\n"


def args(layout: Layout, proxy_bin: str) -> list[str]:
    return [proxy_bin, f"--config={layout.proxy_config}"]
