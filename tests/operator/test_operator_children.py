"""The children as the operator keeps them: every kind watched, hand edits restored, a spec change
told from a hand edit, children the spec no longer asks for pruned, no LIST per reconcile."""

from __future__ import annotations

import logging

import aiohttp
import kopf
from kube_emulator import SERVICE_MONITORS, load_example, running_operator
from test_operator_kmock import IDEP, STS, condition, container, create, settle

from disagg.operator import spec as specs
from disagg.operator.builders import build_children
from disagg.operator.kube import Kube, object_path
from disagg.operator.reconcile import Reconciler

LOG = logging.getLogger("test")
PDB = "policy/v1/poddisruptionbudgets"
HPA = "autoscaling/v2/horizontalpodautoscalers"


def reasons(cluster, reason: str) -> list[dict]:
    return [e for e in cluster.events() if e.get("reason") == reason]


async def merge_patch(cluster, path: str, body: dict, manager: str) -> None:
    """A hand edit (`kubectl patch`/`set image`/`scale`), as another field manager."""
    async with aiohttp.ClientSession() as s:
        async with s.patch(
            f"{cluster.url.rstrip('/')}{path}",
            params={"fieldManager": manager},
            json=body,
            headers={"Content-Type": "application/merge-patch+json"},
        ) as resp:
            assert resp.status == 200, await resp.text()


async def test_a_replica_change_in_the_spec_is_a_scale_not_a_revert(cluster):
    body = load_example("cpu-tiny.yaml")
    await create(cluster, body)
    await settle(cluster)
    body["spec"]["prefill"]["replicas"] = 3
    await cluster.api.apply(body, field_manager="test-user")
    await cluster.eventually(
        lambda: cluster.live(STS, "tiny-prefill")["spec"]["replicas"] == 3, what="scaled"
    )
    (scaled,) = await cluster.eventually(lambda: reasons(cluster, "Scaled"), what="the Scaled event")
    assert scaled["type"] == "Normal" and "tiny-prefill from 1 to 3" in scaled["message"]
    assert reasons(cluster, "ReplicasReverted") == []


async def test_a_hand_edited_template_is_restored_with_one_event(cluster):
    await create(cluster, load_example("cpu-tiny.yaml"))
    await settle(cluster)
    original = container(cluster.live(STS, "tiny-decode"))["image"]
    patch = {
        "spec": {"template": {"spec": {"containers": [{**container(cluster.live(STS, "tiny-decode"))}]}}}
    }
    patch["spec"]["template"]["spec"]["containers"][0]["image"] = "evil/image:latest"
    await merge_patch(
        cluster, "/apis/apps/v1/namespaces/default/statefulsets/tiny-decode", patch, "kubectl-set"
    )
    await cluster.eventually(
        lambda: container(cluster.live(STS, "tiny-decode"))["image"] == original, what="image restored"
    )
    (event,) = await cluster.eventually(lambda: reasons(cluster, "DriftReverted"), what="the revert event")
    assert event["type"] == "Warning" and "StatefulSet tiny-decode" in event["message"]
    assert "containers[worker].image" in event["message"]
    assert reasons(cluster, "Updated") == []


async def test_every_owned_kind_is_watched_a_deleted_budget_comes_back_at_once(cluster):
    await create(cluster, load_example("cpu-tiny.yaml"))
    await settle(cluster)
    for resource, kind, name in (
        (PDB, "PodDisruptionBudget", "tiny-decode"),
        ("v1/configmaps", "ConfigMap", "tiny-config"),
        ("v1/services", "Service", "tiny"),
    ):
        api_version = resource.rsplit("/", 1)[0]
        await cluster.api.delete(api_version, kind, "default", name)
        assert cluster.live(resource, name) is None
        # The resync timer is an hour away here: only the watch can bring it back.
        await cluster.eventually(
            lambda r=resource, n=name: cluster.live(r, n), timeout=5, what=f"{kind} back"
        )


async def test_a_reconcile_reads_children_from_the_cache_not_by_listing(cluster):
    await create(cluster, load_example("cpu-tiny.yaml"))
    await settle(cluster)
    api = Kube(kopf.ConnectionInfo(server=cluster.url, insecure=True))
    calls: list[tuple[str, str]] = []
    send = api.request

    async def recorded(method, path, **kwargs):
        calls.append((method, path))
        return await send(method, path, **kwargs)

    api.request = recorded
    reconciler = Reconciler(api, post=lambda *a, **k: None)
    idep = cluster.live(IDEP, "tiny")
    try:
        await reconciler.reconcile(idep, LOG)  # a fresh process: one GET per child it has not seen yet
        first = list(calls)
        for _ in range(5):
            await reconciler.reconcile(idep, LOG)
    finally:
        await api.close()
    later = calls[len(first) :]
    owner = "/apis/disagg.dev/v1alpha1/namespaces/default/inferencedeployments/tiny"
    wanted = build_children(specs.parse(idep), idep)
    # The credentials Secret is create-only: a fresh process POSTs it once (409: it exists).
    secret = ("POST", "/api/v1/namespaces/default/secrets")
    assert first.count(secret) == 1
    first.remove(secret)
    # (Besides discovery: is the ServiceMonitor kind served?)
    children = sorted(p for m, p in first if p != owner and "/namespaces/" in p)
    assert children == sorted(object_path(m) for m in wanted)
    assert all(m == "GET" for m, _ in first)  # nothing to write: all as desired
    assert later == [("GET", owner)] * 5  # from then on only the owner is read, afresh


async def _prune_case(cluster, body: dict, change, resource: str, names: list[str]) -> None:
    await create(cluster, body)
    for name in names:
        await cluster.eventually(lambda n=name: cluster.live(resource, n), what=f"{resource} {name}")
    change(body["spec"])
    await cluster.api.apply(body, field_manager="test-user")
    for name in names:
        await cluster.eventually(lambda n=name: cluster.live(resource, n) is None, what=f"{name} pruned")
    pruned = await cluster.eventually(lambda: reasons(cluster, "Pruned"), what="the Pruned event")
    assert any(names[0] in e["message"] for e in pruned)
    assert condition(cluster.live(IDEP, "tiny"), "Degraded").get("reason") != "ApplyFailed"


async def test_switching_hpa_to_operator_mode_prunes_the_hpa(cluster):
    body = load_example("cpu-tiny.yaml")
    del body["spec"]["prefill"]["replicas"]
    body["spec"]["prefill"]["autoscaling"] = {
        "maxReplicas": 3,
        "target": {"ttftMilliseconds": 500},
        "mode": "hpa",
    }
    await _prune_case(
        cluster,
        body,
        lambda s: s["prefill"]["autoscaling"].update(mode="operator"),
        HPA,
        ["tiny-prefill"],
    )
    assert cluster.live(STS, "tiny-prefill") is not None  # only the HPA goes


async def test_switching_to_an_external_redis_prunes_the_managed_one(cluster):
    await _prune_case(
        cluster,
        load_example("cpu-tiny.yaml"),
        lambda s: s.update(redis={"external": {"url": "redis://cache.infra.svc:6379/0"}}),
        STS,
        ["tiny-redis"],
    )
    assert cluster.live("v1/services", "tiny-redis") is None


async def test_turning_the_service_monitor_off_prunes_it():
    async with running_operator(extra_resources=SERVICE_MONITORS) as cluster:
        await _prune_case(
            cluster,
            load_example("cpu-tiny.yaml"),
            lambda s: s.update(monitoring={"serviceMonitor": False}),
            "monitoring.coreos.com/v1/servicemonitors",
            ["tiny"],
        )
