"""The real-node suite runs only when DISAGG_NODE_KUBECONFIG names the kubeconfig `make node-up`
writes (a real kubelet, containerd and kube-proxy running the project's own images)."""

from __future__ import annotations

import os

import pytest

KUBECONFIG = os.environ.get("DISAGG_NODE_KUBECONFIG")


def pytest_collection_modifyitems(config, items):
    if KUBECONFIG:
        return
    skip = pytest.mark.skip(
        reason="set DISAGG_NODE_KUBECONFIG (`make node-up` prints it) to run the real-node suite"
    )
    for item in items:
        if os.sep.join(("tests", "cluster", "node")) in str(item.fspath):
            item.add_marker(skip)
