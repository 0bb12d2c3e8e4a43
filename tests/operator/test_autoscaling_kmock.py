"""The autoscaler inside the whole operator: the operator's handlers and the autoscaler's in one
real kopf runtime, against the emulated API server, with a router `/metrics` served here.

The operator builds the StatefulSets from `status.<role>.autoscaling.desiredReplicas`; the
autoscaler writes that status before it scales, so the two never fight. TTFT above target:
prefill goes up to maxReplicas; a hand edit is undone; TTFT below target: prefill
walks down to minReplicas. Decode, within its ITL target, is never touched. (The Events of
the autoscaler are checked in tests/autoscaling/test_timer_kmock.py, which runs it alone.)
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import kmock
import kopf
import pytest
from aiohttp import web
from kube_emulator import RESOURCES, ApiServerEmulator, Cluster, load_example
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from disagg.operator.autoscaling import handlers as autoscaler
from disagg.operator.autoscaling.control import Tuning
from disagg.operator.handlers import register
from disagg.operator.kube import Kube
from disagg.operator.reconcile import Reconciler

IDEP = "disagg.dev/v1alpha1/inferencedeployments"
STS = "apps/v1/statefulsets"


class RouterMetrics:
    """The router's `/metrics`: every scrape adds a batch of requests at the current latency."""

    def __init__(self):
        self.registry = CollectorRegistry()
        lab = ("role", "model")
        self.ttft = Histogram("disagg_time_to_first_token_seconds", "t", lab, registry=self.registry)
        self.itl = Histogram("disagg_inter_token_latency_seconds", "i", lab, registry=self.registry)
        self.ttft_seconds = 1.2  # target 0.5 s: far over
        self.port = 0

    async def handle(self, request):
        for _ in range(10):
            self.ttft.labels(role="router", model="tiny").observe(self.ttft_seconds)
            self.itl.labels(role="router", model="tiny").observe(0.01)  # target 50 ms: well within
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")


@pytest.fixture
async def router_metrics():
    metrics = RouterMetrics()
    app = web.Application()
    app.router.add_get("/metrics", metrics.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    metrics.port = site._server.sockets[0].getsockname()[1]
    yield metrics
    await runner.cleanup()


@pytest.fixture
async def cluster():
    """As the operator suite's fixture, plus the autoscaler (fast ticks, a 1 s window)."""
    async with ApiServerEmulator() as k8s, kmock.Server(k8s) as server:
        for key, info in RESOURCES.items():
            k8s.resources[key] = info
        k8s.resources["v1/pods"] = {"kind": "Pod", "namespaced": True, "verbs": ["list", "get"]}
        conn = kopf.ConnectionInfo(server=str(server.url), insecure=True)
        registry = kopf.OperatorRegistry()
        register(registry, login=lambda **_: conn, resync_seconds=3600)
        settings = autoscaler.Settings(
            interval_seconds=0.3, tuning=Tuning(window_seconds=1.0), metrics_port=0
        )
        autoscaler.register(registry, settings)

        @kopf.on.startup(registry=registry, id="test-speed")
        def _fast_exit(settings: kopf.OperatorSettings, **_):
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
            yield Cluster(k8s, api, reconciler), str(server.url)
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, 20)
            await api.close()
            await reconciler.kube.close()
            assert not thread.is_alive(), "the operator did not stop"


def autoscaled_example() -> dict:
    body = load_example("cpu-tiny.yaml")
    for role, target in (("prefill", {"ttftMilliseconds": 500}), ("decode", {"itlMilliseconds": 50})):
        del body["spec"][role]["replicas"]
        body["spec"][role]["autoscaling"] = {
            "minReplicas": 1,
            "maxReplicas": 3,
            "target": target,
            "scaleDown": {"stabilizationSeconds": 1},
        }
    return body


def router_pod(port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "tiny-router-7d9f-x2x",
            "namespace": "default",
            "labels": {"disagg.dev/deployment": "tiny", "disagg.dev/role": "router"},
            "annotations": {"prometheus.io/port": str(port)},
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def replicas(cluster: Cluster, role: str) -> int | None:
    sts = cluster.live(STS, f"tiny-{role}")
    return None if sts is None else sts["spec"].get("replicas")


def autoscaling_status(cluster: Cluster, role: str) -> dict:
    return ((cluster.live(IDEP, "tiny").get("status") or {}).get(role) or {}).get("autoscaling") or {}


def record(cluster: Cluster, seen: dict[str, list[int]]) -> None:
    for role in ("prefill", "decode"):
        n = replicas(cluster, role)
        if n is not None and (not seen[role] or seen[role][-1] != n):
            seen[role].append(n)


async def play_statefulset_controller(cluster: Cluster, seen: dict[str, list[int]]):
    """Pods become ready a moment after replicas change; record every replica count seen."""
    while True:
        record(cluster, seen)
        for role in ("prefill", "decode"):
            sts = cluster.live(STS, f"tiny-{role}")
            if sts is not None and (sts.get("status") or {}).get("readyReplicas") != sts["spec"].get(
                "replicas"
            ):
                await asyncio.sleep(0.2)
                await cluster.mark_ready("StatefulSet", f"tiny-{role}")
        await asyncio.sleep(0.05)


async def test_operator_and_autoscaler_share_the_replica_count(cluster, router_metrics):
    cluster, url = cluster
    cluster.k8s.objects["v1/pods", "default", "tiny-router-7d9f-x2x"] = router_pod(router_metrics.port)
    await cluster.api.apply(autoscaled_example())
    await cluster.eventually(
        lambda: replicas(cluster, "prefill") == 1, what="prefill StatefulSet at minReplicas"
    )
    seen: dict[str, list[int]] = {"prefill": [], "decode": []}
    controller = asyncio.create_task(play_statefulset_controller(cluster, seen))
    try:
        await cluster.eventually(
            lambda: replicas(cluster, "prefill") == 3, timeout=20, what="prefill scaled up"
        )
        status = autoscaling_status(cluster, "prefill")
        assert status["desiredReplicas"] == 3 and "TTFT p90" in status["decisions"][-1]["reason"]

        # A hand edit is undone: by the operator's re-apply (it builds replicas from the status)
        # or by the autoscaler's watch, whichever runs first; the Event is the autoscaler's test.
        async with aiohttp.ClientSession() as s:
            async with s.patch(
                f"{url}/apis/apps/v1/namespaces/default/statefulsets/tiny-prefill",
                json={"spec": {"replicas": 7}},
                headers={"Content-Type": "application/merge-patch+json"},
            ) as resp:
                assert resp.status == 200 and (await resp.json())["spec"]["replicas"] == 7
        await cluster.eventually(
            lambda: replicas(cluster, "prefill") == 3, timeout=10, what="hand edit undone"
        )

        router_metrics.ttft_seconds = 0.05
        await cluster.eventually(
            lambda: replicas(cluster, "prefill") == 1, timeout=30, what="prefill scaled down"
        )
        downs = [d for d in autoscaling_status(cluster, "prefill")["decisions"] if d["action"] == "down"]
        assert [(d["from"], d["to"]) for d in downs] == [(3, 2), (2, 1)]
    finally:
        controller.cancel()
    record(cluster, seen)
    assert seen["prefill"][:3] == [1, 2, 3] and seen["prefill"][-3:] == [3, 2, 1]  # (a 7 may show in between)
    assert set(seen["decode"]) == {1}
    assert autoscaling_status(cluster, "decode")["desiredReplicas"] == 1
    # The operator's own re-apply agrees with the autoscaler's last word.
    assert (
        cluster.live(STS, "tiny-prefill")["spec"]["replicas"]
        == autoscaling_status(cluster, "prefill")["desiredReplicas"]
    )
