"""The kubelet's configuration: cgroup v1 allowed, its own cgroup subtree, containerd's socket,
serving on the node's address only, DNS from the node, and images never garbage-collected (they
were imported by hand and cannot be pulled again). Pure."""

from __future__ import annotations

import json

from .layout import Layout
from .settings import Config

PORT = 10250  # inside the namespace: nothing of the host's is in the way
HEALTHZ_PORT = 10248


def config(config: Config, layout: Layout, pki_dir: str) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # kubelet 1.36 refuses cgroup v1 unless told otherwise (it then only warns)
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{config.cgroup_root}",
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "address": config.node_ip,
        "port": PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": HEALTHZ_PORT,
        # the API server's client certificate, from the rig's CA; no anonymous requests
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": f"{pki_dir}/ca.crt"},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "tlsCertFile": f"{pki_dir}/kubelet-serving.crt",
        "tlsPrivateKeyFile": f"{pki_dir}/kubelet-serving.key",
        "failSwapOn": False,
        "clusterDomain": config.cluster_domain,
        "clusterDNS": [config.dns_ip],
        "resolvConf": str(layout.resolv_conf),
        "podLogsDir": str(layout.pod_logs),
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
    }


def render(cfg: Config, layout: Layout, pki_dir: str) -> str:
    return json.dumps(config(cfg, layout, pki_dir), indent=2) + "\n"


def args(cfg: Config, layout: Layout, kubelet_bin: str) -> list[str]:
    return [
        kubelet_bin,
        f"--config={layout.kubelet_config}",
        f"--kubeconfig={layout.kubeconfig_of('kubelet')}",
        f"--root-dir={layout.kubelet_root}",
        f"--cert-dir={layout.kubelet_root}/pki",
        f"--hostname-override={cfg.node_name}",
        f"--node-ip={cfg.node_ip}",
    ]
