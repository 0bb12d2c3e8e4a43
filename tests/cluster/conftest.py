"""The real-cluster suite runs only when DISAGG_TEST_KUBECONFIG names a kubeconfig."""

from __future__ import annotations

import os

import pytest

KUBECONFIG = os.environ.get("DISAGG_TEST_KUBECONFIG")


def pytest_collection_modifyitems(config, items):
    if KUBECONFIG:
        return
    skip = pytest.mark.skip(reason="set DISAGG_TEST_KUBECONFIG to a kubeconfig to run the cluster suite")
    node = os.sep.join(("tests", "cluster", "node"))  # its own switch: node/conftest.py
    for item in items:
        path = str(item.fspath)
        if os.sep.join(("tests", "cluster")) in path and node not in path:
            item.add_marker(skip)
