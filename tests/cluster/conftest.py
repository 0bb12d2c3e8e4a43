"""The real-cluster suite runs only when DISAGG_TEST_KUBECONFIG names a kubeconfig."""

from __future__ import annotations

import os

import pytest

KUBECONFIG = os.environ.get("DISAGG_TEST_KUBECONFIG")


def pytest_collection_modifyitems(config, items):
    if KUBECONFIG:
        return
    skip = pytest.mark.skip(reason="set DISAGG_TEST_KUBECONFIG to a kubeconfig to run the cluster suite")
    for item in items:
        if "tests/cluster" in str(item.fspath):
            item.add_marker(skip)
