"""The pods' network: a bridge in the node's namespace, host-local addresses from the pod range,
pod traffic masqueraded when it leaves the range, and port mappings. Pure."""

from __future__ import annotations

import json

from .layout import Layout
from .settings import Config

FILE_NAME = "10-disagg-node.conflist"
NETWORK_NAME = "disagg-node-pods"


def conflist(config: Config, layout: Layout) -> dict:
    return {
        "cniVersion": "1.0.0",
        "name": NETWORK_NAME,
        "plugins": [
            {
                "type": "bridge",
                "bridge": config.bridge,
                "isGateway": True,
                "ipMasq": True,
                # a pod reaching itself through a Service comes back over the bridge
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(layout.cni_ipam_dir),
                    "ranges": [[{"subnet": config.pod_cidr, "gateway": config.pod_gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def render(config: Config, layout: Layout) -> str:
    return json.dumps(conflist(config, layout), indent=2) + "\n"
