"""The autoscaler's kopf handlers in the real kopf runtime against kmock (an in-memory
Kubernetes API), with a router `/metrics` endpoint served here over real HTTP.

TTFT above target: prefill goes up proportionally (at most doubling per step) to maxReplicas; a hand
edit of its replicas is reverted with an Event; TTFT below target: prefill walks down one step
per (shortened) window. Decode, within its ITL target all along, is never touched. Status and
Events say why at each step. The test plays the StatefulSet controller (ready follows replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time

import aiohttp
import kmock
import kopf
import pytest
from kmock._internal import enums
from prometheus_client import REGISTRY

from disagg.operator.autoscaling import handlers as autoscaler
from disagg.operator.autoscaling.control import Tuning
from disagg.operator.kube import Kube

from .router_metrics import RouterMetrics, router_pod, serving_router_metrics

IDEP = "disagg.dev/v1alpha1/inferencedeployments"
STS = "apps/v1/statefulsets"
RESOURCES = {
    "v1/namespaces": {"kind": "Namespace", "namespaced": False, "verbs": ["list", "watch", "get"]},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition", "namespaced": False, "verbs": ["list", "watch", "get"],
    },
    IDEP: {"kind": "InferenceDeployment", "namespaced": True, "subresources": ["status"],
           "verbs": ["list", "watch", "get", "patch"]},
    STS: {"kind": "StatefulSet", "namespaced": True, "verbs": ["list", "watch", "get", "patch"]},
    "v1/pods": {"kind": "Pod", "namespaced": True, "verbs": ["list", "get"]},
    "v1/events": {"kind": "Event", "namespaced": True, "verbs": ["create", "list"]},
}  # fmt: skip


class Emulator(kmock.KubernetesEmulator):
    """kmock, plus `metadata.generateName` on create (kopf names its Events that way)."""

    created = 0

    async def _handle(self, request):
        data = request.data if isinstance(request.data, dict) else None
        meta = (data or {}).get("metadata") or {}
        if request.action == enums.action.CREATE and meta.get("generateName") and not meta.get("name"):
            Emulator.created += 1
            meta["name"] = f"{meta['generateName']}{Emulator.created:05d}"
        return await super()._handle(request)


@pytest.fixture
async def router_metrics():
    async with serving_router_metrics() as metrics:
        yield metrics


def idep() -> dict:
    def auto(target):
        return {
            "minReplicas": 1,
            "maxReplicas": 3,
            "target": target,
            "scaleDown": {"stabilizationSeconds": 1},
        }

    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "InferenceDeployment",
        # kopf's finalizer patch tests resourceVersion (kmock keeps it as given).
        "metadata": {"name": "tiny", "namespace": "default", "uid": "uid-1", "resourceVersion": "1"},
        "spec": {
            "prefill": {"autoscaling": auto({"ttftMilliseconds": 500})},
            "decode": {"autoscaling": auto({"itlMilliseconds": 50})},
        },
    }


def statefulset(role: str) -> dict:
    labels = {"app.kubernetes.io/managed-by": "disagg-operator", "disagg.dev/deployment": "tiny",
              "disagg.dev/role": role}  # fmt: skip
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": f"tiny-{role}", "namespace": "default", "labels": labels},
        "spec": {"replicas": 1},
        "status": {"replicas": 1, "readyReplicas": 1},
    }


class World:
    def __init__(self, k8s, url):
        self.k8s, self.url = k8s, url

    def live(self, resource: str, name: str) -> dict:
        return copy.deepcopy(dict(self.k8s.objects[resource, "default", name].raw))

    def replicas(self, role: str) -> int:
        return self.live(STS, f"tiny-{role}")["spec"]["replicas"]

    def autoscaling(self, role: str) -> dict:
        return ((self.live(IDEP, "tiny").get("status") or {}).get(role) or {}).get("autoscaling") or {}

    def events(self) -> list[dict]:
        return [
            dict(o.raw)
            for (res, _, _), o in self.k8s.objects.items()
            if getattr(res, "plural", "") == "events"
        ]

    async def eventually(self, check, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while not (value := check()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.05)
        return value


def autoscaler_alone(url: str) -> tuple[kopf.OperatorRegistry, Kube]:
    """A registry with only a login handler, and the API client the autoscaler is handed."""
    conn = kopf.ConnectionInfo(server=url, insecure=True)
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry, id="login")(lambda **_: conn)
    return registry, Kube(conn)


@contextlib.asynccontextmanager
async def running_world(router_metrics):
    """kmock plus the operator, started and stopped inside the test's own task: kopf cancels,
    at exit, every task created after it started (a fixture's teardown task would be one)."""
    async with Emulator() as k8s, kmock.Server(k8s) as server:
        for key, info in RESOURCES.items():
            k8s.resources[key] = info
        k8s.objects[IDEP, "default", "tiny"] = idep()
        for role in ("prefill", "decode"):
            k8s.objects[STS, "default", f"tiny-{role}"] = statefulset(role)
        k8s.objects["v1/pods", "default", "tiny-router-7d9f-x2x"] = router_pod(router_metrics.port)
        registry, kube = autoscaler_alone(str(server.url))
        settings = autoscaler.Settings(
            interval_seconds=0.3, tuning=Tuning(window_seconds=1.0), metrics_port=0
        )
        autoscaler.register(registry, kube=kube, settings=settings)
        stop = asyncio.Event()
        task = asyncio.create_task(
            kopf.operator(registry=registry, clusterwide=True, standalone=True, stop_flag=stop)
        )
        try:
            yield World(k8s, str(server.url))
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
            await kube.close()


def record(world: World, seen: dict[str, list[int]]) -> None:
    for role in ("prefill", "decode"):
        n = world.replicas(role)
        if not seen[role] or seen[role][-1] != n:
            seen[role].append(n)


async def play_statefulset_controller(world: World, seen: dict[str, list[int]]):
    """Pods become ready a moment after replicas change; record every replica count seen."""
    while True:
        record(world, seen)
        for role in ("prefill", "decode"):
            sts = world.live(STS, f"tiny-{role}")
            n = sts["spec"]["replicas"]
            if sts["status"].get("readyReplicas") != n:
                await asyncio.sleep(0.2)
                world.k8s.objects[STS, "default", f"tiny-{role}"].patch({"status": {"readyReplicas": n}})
        await asyncio.sleep(0.05)


async def test_prefill_follows_ttft_decode_untouched(router_metrics):
    async with running_world(router_metrics) as world:
        await prefill_follows_ttft_decode_untouched(world, router_metrics)


async def prefill_follows_ttft_decode_untouched(world: World, router_metrics: RouterMetrics):
    seen: dict[str, list[int]] = {"prefill": [], "decode": []}
    controller = asyncio.create_task(play_statefulset_controller(world, seen))
    try:
        # TTFT p90 over target (x4.7): up, doubling per step, to maxReplicas.
        await world.eventually(lambda: world.replicas("prefill") == 3, 20, "prefill scaled up")
        status = world.autoscaling("prefill")
        up = [d for d in status["decisions"] if d["action"] == "up"][-1]
        assert (up["from"], up["to"]) == (2, 3)
        assert "TTFT p90" in up["reason"] and "over limit" in up["reason"]
        assert status["desiredReplicas"] == 3 and status["target"] == 500 and status["lastScaleTime"]
        assert status["currentMetric"] > 500

        # A hand edit of an autoscaled pool is undone at once, and the Event says why.
        await world.eventually(
            lambda: world.live(STS, "tiny-prefill")["status"]["readyReplicas"] == 3, 5, "ready"
        )
        async with aiohttp.ClientSession() as s:
            async with s.patch(
                f"{world.url}/apis/apps/v1/namespaces/default/statefulsets/tiny-prefill",
                json={"spec": {"replicas": 7}},
                headers={"Content-Type": "application/merge-patch+json"},
            ) as resp:
                assert resp.status == 200
        reverted = await world.eventually(
            lambda: [e for e in world.events() if e.get("reason") == "ReplicasReverted"],
            10,
            "the revert Event",
        )
        assert "changed to 7 outside the autoscaler; restored 3" in reverted[0]["message"]
        assert reverted[0]["type"] == "Warning"
        await world.eventually(lambda: world.replicas("prefill") == 3, 5, "the hand edit undone")

        # TTFT far under target: down one step per window, to minReplicas.
        router_metrics.ttft_seconds = 0.05
        await world.eventually(lambda: world.replicas("prefill") == 1, 30, "prefill scaled down")
        downs = [d for d in world.autoscaling("prefill")["decisions"] if d["action"] == "down"]
        assert [(d["from"], d["to"]) for d in downs] == [(3, 2), (2, 1)]
        assert all("load fits on fewer" in d["reason"] and "TTFT p90" in d["reason"] for d in downs)
        assert world.autoscaling("prefill")["currentMetric"] < 500
    finally:
        controller.cancel()
    record(world, seen)

    assert seen["prefill"][:3] == [1, 2, 3] and seen["prefill"][-3:] == [3, 2, 1]
    assert set(seen["decode"]) == {1}  # decode never moved
    decode = world.autoscaling("decode")
    assert decode["desiredReplicas"] == 1 and decode["target"] == 50
    assert decode["decisions"][-1]["code"] == "AtMinReplicas"
    assert "ITL p90" in decode["decisions"][-1]["reason"]

    def scaled():
        return [e["message"] for e in world.events() if e.get("reason") == "ScaledPrefill"]

    await world.eventually(lambda: len(scaled()) == 4, 5, "an Event for each change")  # posted asynchronously
    assert [m.rsplit(": ", 1)[1] for m in scaled()] == ["1 -> 2", "2 -> 3", "3 -> 2", "2 -> 1"]
    assert scaled()[0].startswith("prefill (TTFT): TTFT p90 over limit")
    assert not [e for e in world.events() if e.get("reason") == "ScaledDecode"]
    # The autoscaler's own metrics tell the same story.
    lab = {"namespace": "default", "deployment": "tiny", "role": "prefill"}
    assert REGISTRY.get_sample_value("disagg_autoscaler_desired_replicas", lab) == 1
    assert REGISTRY.get_sample_value("disagg_autoscaler_target_seconds", lab) == 0.5
    ups = REGISTRY.get_sample_value(
        "disagg_autoscaler_decisions_total", {**lab, "action": "up", "reason": "ScaleUp"}
    )
    downs = REGISTRY.get_sample_value(
        "disagg_autoscaler_decisions_total", {**lab, "action": "down", "reason": "ScaleDown"}
    )
    assert ups >= 2 and downs >= 2
    # Warming up (the first scrape has no window yet) is not worth a Warning.
    assert not [e for e in world.events() if e.get("reason") == "MetricsMissing"]


async def test_invalid_section_is_reported_not_acted_on(router_metrics):
    async with Emulator() as k8s, kmock.Server(k8s) as server:
        for key, info in RESOURCES.items():
            k8s.resources[key] = info
        bad = idep()
        bad["spec"]["prefill"]["autoscaling"]["target"] = {"itlMilliseconds": 20}
        k8s.objects[IDEP, "default", "tiny"] = bad
        k8s.objects[STS, "default", "tiny-prefill"] = statefulset("prefill")
        registry, kube = autoscaler_alone(str(server.url))
        autoscaler.register(
            registry, kube=kube, settings=autoscaler.Settings(interval_seconds=0.2, metrics_port=0)
        )
        stop = asyncio.Event()
        task = asyncio.create_task(
            kopf.operator(registry=registry, clusterwide=True, standalone=True, stop_flag=stop)
        )
        world = World(k8s, str(server.url))
        try:
            warned = await world.eventually(
                lambda: [e for e in world.events() if e.get("reason") == "InvalidAutoscaling"],
                10,
                "a Warning",
            )
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
            await kube.close()
    assert warned[0]["message"].startswith("spec.prefill.autoscaling.target: prefill autoscales on time to")
    assert world.replicas("prefill") == 1
