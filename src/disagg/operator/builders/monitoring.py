"""A Prometheus Operator ServiceMonitor for the workers' and router's /metrics."""

from __future__ import annotations

from disagg.operator import constants as c
from disagg.operator.builders import common
from disagg.operator.spec import InferenceDeployment

API_VERSION = "monitoring.coreos.com/v1"
RESOURCE = "monitoring.coreos.com/v1/servicemonitors"


def service_monitor(idep: InferenceDeployment) -> dict:
    interval = idep.spec.monitoring.interval
    return {
        "apiVersion": API_VERSION,
        "kind": "ServiceMonitor",
        "metadata": common.metadata(idep, idep.name, "monitoring"),
        "spec": {
            "selector": {"matchLabels": {c.LABEL_INSTANCE: idep.name, c.LABEL_PART_OF: "disagg"}},
            "namespaceSelector": {"matchNames": [idep.namespace]},
            # Worker Services name their port "metrics", the API Service "http"; each matches its own.
            "endpoints": [
                {"port": "metrics", "path": "/metrics", "interval": interval},
                {"port": "http", "path": "/metrics", "interval": interval},
            ],
        },
    }
