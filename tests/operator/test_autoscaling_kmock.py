"""The autoscaler inside the whole operator: the operator's handlers and the autoscaler's in one
real kopf runtime, sharing one API client, against the emulated API server (which keeps
server-side apply's field ownership), with a router `/metrics` served here.

The autoscaler alone owns the autoscaled StatefulSets' replicas (field manager
`disagg-autoscaler`); the operator sets them only when it creates a StatefulSet and leaves them
out of every later apply. TTFT above target: prefill goes up to maxReplicas; a hand edit is
undone with a Warning Event that says why; a template change applied meanwhile keeps the count
(the emulator would reset a field nobody applies to 1); TTFT below target: prefill walks down
to minReplicas. Decode, within its ITL target, is never touched. No replica count the
StatefulSet ever shows moves against the autoscaler's decisions.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from autoscaling.router_metrics import router_pod, serving_router_metrics
from kube_emulator import Cluster, load_example, running_operator

from disagg.operator.autoscaling import handlers as autoscaler
from disagg.operator.autoscaling.control import Tuning
from disagg.operator.replicas import AUTOSCALER_MANAGER, managers_of

IDEP = "disagg.dev/v1alpha1/inferencedeployments"
STS = "apps/v1/statefulsets"


@pytest.fixture
async def router_metrics():
    async with serving_router_metrics() as metrics:
        yield metrics


@pytest.fixture
async def cluster():
    """The operator's suite fixture plus the autoscaler (fast ticks, a 1 s window)."""
    settings = autoscaler.Settings(interval_seconds=0.3, tuning=Tuning(window_seconds=1.0), metrics_port=0)
    async with running_operator(settings) as cluster:
        yield cluster


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
    """Pods become ready (and roll out) a moment after the spec changes; record every replica count."""
    while True:
        record(cluster, seen)
        for role in ("prefill", "decode"):
            sts = cluster.live(STS, f"tiny-{role}")
            status = (sts or {}).get("status") or {}
            if sts is not None and (
                status.get("readyReplicas") != sts["spec"].get("replicas")
                or status.get("observedGeneration") != sts["metadata"].get("generation")
            ):
                await asyncio.sleep(0.2)
                await cluster.mark_ready("StatefulSet", f"tiny-{role}")
        await asyncio.sleep(0.05)


def history(cluster: Cluster, name: str) -> list[int]:
    """Every replica count the StatefulSet has had, write by write (kmock keeps each version)."""
    for (res, ns, obj_name), obj in cluster.k8s.objects.items():
        if (res.group, res.plural, ns, obj_name) == ("apps", "statefulsets", "default", name):
            counts = [(v.raw.get("spec") or {}).get("replicas") for v in obj.history if v is not None]
            return [n for i, n in enumerate(counts) if i == 0 or n != counts[i - 1]]
    return []


async def hand_edit(url: str, replicas: int) -> None:
    """`kubectl scale`, as a merge patch by another field manager."""
    async with aiohttp.ClientSession() as s:
        async with s.patch(
            f"{url}/apis/apps/v1/namespaces/default/statefulsets/tiny-prefill",
            params={"fieldManager": "kubectl-scale"},
            json={"spec": {"replicas": replicas}},
            headers={"Content-Type": "application/merge-patch+json"},
        ) as resp:
            assert resp.status == 200 and (await resp.json())["spec"]["replicas"] == replicas


async def test_operator_and_autoscaler_share_the_replica_count(cluster, router_metrics):
    cluster.k8s.objects["v1/pods", "default", "tiny-router-7d9f-x2x"] = router_pod(router_metrics.port)
    body = autoscaled_example()
    await cluster.api.apply(body, field_manager="test-user")
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
        # The autoscaler, not the operator, owns the count now.
        assert managers_of(cluster.live(STS, "tiny-prefill"), "spec", "replicas") == {AUTOSCALER_MANAGER}

        # A template change: the operator applies without replicas; the count stays (no reset to 1).
        body["spec"]["image"]["tag"] = "0.2.0-cpu"
        await cluster.api.apply(body, field_manager="test-user")
        await cluster.eventually(
            lambda: (
                "0.2.0-cpu"
                in cluster.live(STS, "tiny-prefill")["spec"]["template"]["spec"]["containers"][0]["image"]
            ),
            timeout=10,
            what="prefill template updated",
        )
        assert replicas(cluster, "prefill") == 3

        # A hand edit is undone once, by the autoscaler, with a Warning Event saying why.
        await hand_edit(cluster.url, 7)
        await cluster.eventually(
            lambda: replicas(cluster, "prefill") == 3, timeout=10, what="hand edit undone"
        )
        reverted = await cluster.eventually(
            lambda: [e for e in cluster.events() if e.get("reason") == "ReplicasReverted"],
            what="the revert Event",
        )
        assert reverted[0]["type"] == "Warning"
        assert "changed to 7 outside the autoscaler; restored 3" in reverted[0]["message"]
        assert "spec.prefill.autoscaling owns the replica count" in reverted[0]["message"]
        decisions = autoscaling_status(cluster, "prefill")["decisions"]
        assert [(d["from"], d["to"]) for d in decisions if d["action"] == "revert"] == [(7, 3)]

        router_metrics.ttft_seconds = 0.05
        await cluster.eventually(
            lambda: replicas(cluster, "prefill") == 1, timeout=30, what="prefill scaled down"
        )
        downs = [d for d in autoscaling_status(cluster, "prefill")["decisions"] if d["action"] == "down"]
        assert [(d["from"], d["to"]) for d in downs] == [(3, 2), (2, 1)]
    finally:
        controller.cancel()
    await asyncio.sleep(0.5)  # a few more ticks and reconciles: nothing may move it again
    record(cluster, seen)

    # Every count the prefill StatefulSet ever had, in order: up with the autoscaler, the one hand
    # edit and its revert, down with the autoscaler. A reconcile that re-applied an old count
    # ("changed to 1 ... restored 2"), or a reset to 1 by an apply without replicas, would show here.
    assert history(cluster, "tiny-prefill") == [1, 2, 3, 7, 3, 2, 1]
    assert len([e for e in cluster.events() if e.get("reason") == "ReplicasReverted"]) == 1
    assert history(cluster, "tiny-decode") == [1]
    assert autoscaling_status(cluster, "decode")["desiredReplicas"] == 1
    assert (
        cluster.live(STS, "tiny-prefill")["spec"]["replicas"]
        == autoscaling_status(cluster, "prefill")["desiredReplicas"]
    )


async def test_a_deletion_during_a_tick_waits_for_the_tick_not_a_minute(monkeypatch):
    # kopf keeps the finalizer until a running timer returns, then polls for it (every 60 s by
    # default): a deletion that lands mid-tick must finish soon after the tick does.
    ticking = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def slow_tick(tick, memo):
        loop.call_soon_threadsafe(ticking.set)  # kopf runs in its own thread and loop
        await asyncio.sleep(2.0)

    monkeypatch.setattr(autoscaler, "autoscale", slow_tick)
    settings = autoscaler.Settings(interval_seconds=0.3, tuning=Tuning(window_seconds=1.0), metrics_port=0)
    async with running_operator(settings) as cluster:
        await cluster.api.apply(autoscaled_example(), field_manager="user")
        await cluster.eventually(lambda: cluster.live(STS, "tiny-decode"), what="the decode StatefulSet")
        ticking.clear()
        await asyncio.wait_for(ticking.wait(), 10)
        await cluster.api.delete("disagg.dev/v1alpha1", "InferenceDeployment", "default", "tiny")
        await cluster.eventually(lambda: cluster.live(IDEP, "tiny") is None, timeout=20, what="deleted")
