"""The `cluster` fixture: the real kopf runtime running our handlers against kmock (see kube_emulator)."""

from __future__ import annotations

import asyncio
import threading

import kmock
import kopf
import pytest
from kube_emulator import RESOURCES, ApiServerEmulator, Cluster

from disagg.operator.handlers import register
from disagg.operator.kube import Kube
from disagg.operator.reconcile import Reconciler


@pytest.fixture
async def cluster():
    """kmock serves in the test's event loop; kopf runs in its own thread and loop, as in production
    (kopf cancels every task started after it, which would include the test's own teardown)."""
    async with ApiServerEmulator() as k8s, kmock.Server(k8s) as server:
        for key, info in RESOURCES.items():
            k8s.resources[key] = info
        conn = kopf.ConnectionInfo(server=str(server.url), insecure=True)
        registry = kopf.OperatorRegistry()
        register(registry, login=lambda **_: conn, resync_seconds=3600)

        @kopf.on.startup(registry=registry, id="test-speed")
        def _fast_exit(settings: kopf.OperatorSettings, **_):
            # Do not keep a stopping test operator waiting for in-flight work it will never finish.
            settings.queueing.exit_timeout = 0.2
            settings.background.instant_exit_timeout = 0.2

        stop = threading.Event()
        thread = threading.Thread(
            target=lambda: asyncio.run(
                kopf.operator(registry=registry, clusterwide=True, standalone=True, stop_flag=stop)
            ),
            name="kopf",
            daemon=True,
        )
        thread.start()
        api = Kube(conn)
        reconciler = Reconciler(Kube(conn))
        try:
            yield Cluster(k8s, api, reconciler)
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, 20)
            await api.close()
            await reconciler.kube.close()
            assert not thread.is_alive(), "the operator did not stop"
