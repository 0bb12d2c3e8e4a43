"""API objects the rig writes itself. Pure."""

from __future__ import annotations

from .settings import Config


def kubernetes_endpointslice(cfg: Config) -> dict:
    """The `kubernetes` Service's endpoint: the API relay on the host's link address (the API
    server runs with --endpoint-reconciler-type=none and listens on the loopback only)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kubernetes",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": "kubernetes"},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [cfg.host_ip], "conditions": {"ready": True}}],
        "ports": [{"name": "https", "port": cfg.api_port, "protocol": "TCP"}],
    }
