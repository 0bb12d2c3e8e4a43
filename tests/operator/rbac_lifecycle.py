"""Every call the operator process makes over a whole lifecycle, recorded by the emulated API server.

The operator with the autoscaler, against an API that serves ServiceMonitors (kopf watching every
namespace: the emulator cannot serve the namespace listing a namespaced kopf makes; see
test_operator_rbac for that one): create with every child kind (HPA mode for decode, operator mode for
prefill, NetworkPolicies, ServiceMonitor, managed Redis), mark the workloads ready, delete a child
by hand (recreated), turn the NetworkPolicies off and switch to an external Redis (pruned), run
decode across nodes (a LeaderWorkerSet, against an API that serves them) and back (pruned), then
delete the resource (finalizer, cleanup Job). The tests' own calls are told apart by User-Agent.
"""

from __future__ import annotations

from kube_emulator import (
    IDEP_RESOURCE,
    LEADER_WORKER_SETS,
    SERVICE_MONITORS,
    TEST_CLIENT,
    load_example,
    running_operator,
)

from disagg.operator import constants as c
from disagg.operator.autoscaling import handlers as autoscaler
from disagg.operator.autoscaling.control import Tuning
from disagg.operator.settings import Settings

NAMESPACE = "default"


def _body() -> dict:
    body = load_example("cpu-tiny.yaml", namespace=NAMESPACE)
    del body["spec"]["prefill"]["replicas"]
    body["spec"]["prefill"]["autoscaling"] = {"maxReplicas": 3, "target": {"ttftMilliseconds": 500}}
    del body["spec"]["decode"]["replicas"]
    body["spec"]["decode"]["autoscaling"] = {
        "maxReplicas": 3,
        "target": {"itlMilliseconds": 50},
        "mode": "hpa",
    }
    return body


async def record() -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every call the operator process made."""
    tuned = autoscaler.Settings(interval_seconds=0.3, tuning=Tuning(window_seconds=1.0), metrics_port=0)
    async with running_operator(
        tuned, {**SERVICE_MONITORS, **LEADER_WORKER_SETS}, settings=Settings(operator_namespace="ops")
    ) as cluster:
        body = _body()
        await cluster.api.apply(body, field_manager="user")
        for resource, name in (
            ("networking.k8s.io/v1/networkpolicies", "tiny-redis"),
            ("monitoring.coreos.com/v1/servicemonitors", "tiny"),
            ("autoscaling/v2/horizontalpodautoscalers", "tiny-decode"),
            ("policy/v1/poddisruptionbudgets", "tiny-router"),
        ):
            await cluster.eventually(lambda r=resource, n=name: cluster.live(r, n), what=f"{resource} {name}")
        for kind, name in (
            ("StatefulSet", "tiny-decode"),
            ("StatefulSet", "tiny-prefill"),
            ("Deployment", "tiny-router"),
            ("StatefulSet", "tiny-redis"),
        ):
            await cluster.mark_ready(kind, name)
        # A few autoscaler ticks (metrics missing: it still reads pods and writes its status).
        await cluster.eventually(
            lambda: (
                ((cluster.live(IDEP_RESOURCE, "tiny") or {}).get("status") or {})
                .get("prefill", {})
                .get("autoscaling")
            ),
            what="an autoscaler decision",
        )
        await cluster.api.delete("policy/v1", "PodDisruptionBudget", NAMESPACE, "tiny-router")
        # Children that leave the desired set are pruned: HPA (hpa -> operator mode), ServiceMonitor.
        body["spec"]["decode"]["autoscaling"]["mode"] = "operator"
        body["spec"]["monitoring"] = {"serviceMonitor": False}
        await cluster.api.apply(body, field_manager="user")
        await cluster.eventually(
            lambda: (
                cluster.live("autoscaling/v2/horizontalpodautoscalers", "tiny-decode") is None
                and cluster.live("monitoring.coreos.com/v1/servicemonitors", "tiny") is None
            ),
            what="HPA and ServiceMonitor pruned",
        )
        await cluster.eventually(
            lambda: cluster.live("policy/v1/poddisruptionbudgets", "tiny-router"), what="back"
        )

        body["spec"]["networkPolicy"] = {"enabled": False}
        body["spec"]["redis"] = {
            "external": {"url": "redis://cache:6379/0", "passwordSecret": {"name": "auth"}}
        }
        await cluster.api.apply(body, field_manager="user")
        await cluster.eventually(
            lambda: cluster.live("networking.k8s.io/v1/networkpolicies", "tiny-router") is None, what="pruned"
        )
        # Decode across nodes: a LeaderWorkerSet instead of its StatefulSet, then back (LWS pruned).
        # (autoscaled in hpa mode: the HPA scales the LWS; the operator's own autoscaler scales
        # StatefulSets only)
        decode = body["spec"]["decode"]
        decode["autoscaling"]["mode"] = "hpa"
        decode.update(tensorParallelSize=16, resources={"limits": {"memory": "2Gi", "nvidia.com/gpu": 8}})
        await cluster.api.apply(body, field_manager="user")
        lws = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
        await cluster.eventually(lambda: cluster.live(lws, "tiny-decode-lws"), what="the LeaderWorkerSet")
        decode["autoscaling"]["mode"] = "operator"
        decode.update(tensorParallelSize=1, resources={"limits": {"memory": "2Gi"}})
        await cluster.api.apply(body, field_manager="user")
        await cluster.eventually(lambda: cluster.live(lws, "tiny-decode-lws") is None, what="LWS pruned")
        await cluster.api.delete(c.API_VERSION, c.KIND, NAMESPACE, "tiny")
        await cluster.eventually(lambda: cluster.live(IDEP_RESOURCE, "tiny") is None, what="deleted")
        assert cluster.live("batch/v1/jobs", "tiny-cleanup-uid-1") is not None
        return {(g, r, v) for client, g, r, v in cluster.k8s.calls if client != TEST_CLIENT}
