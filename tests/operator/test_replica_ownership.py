"""One owner of an autoscaled pool's replicas, in server-side-apply terms, against the emulated API
server's field ownership (which removes a field its only manager stops applying, as a cluster does).

The reconciler runs here directly (no kopf runtime), so every write is the test's to order.
"""

from __future__ import annotations

import logging

import pytest
from kube_emulator import Cluster, emulated_api, load_example

from disagg.operator import replicas
from disagg.operator.autoscaling.ownership import ReplicaOwner
from disagg.operator.constants import FIELD_MANAGER
from disagg.operator.kube import KubeError
from disagg.operator.reconcile import Reconciler

LOG = logging.getLogger("test")
STS = ("apps/v1", "StatefulSet", "default")


def autoscaled(min_replicas: int = 2) -> dict:
    body = load_example("cpu-tiny.yaml")
    del body["spec"]["prefill"]["replicas"]
    body["spec"]["prefill"]["autoscaling"] = {
        "minReplicas": min_replicas,
        "maxReplicas": 5,
        "target": {"ttftMilliseconds": 500},
    }
    return body


async def prefill(api) -> dict:
    return await api.get(*STS, "tiny-prefill")


async def create_autoscaled(api, min_replicas: int) -> tuple[dict, Reconciler]:
    body = autoscaled(min_replicas)
    await api.apply(body, field_manager="test-user")
    reconciler = Reconciler(api, post=lambda *a, **k: None)
    await reconciler.reconcile(
        await api.get("disagg.dev/v1alpha1", "InferenceDeployment", "default", "tiny"), LOG
    )
    return body, reconciler


async def change_template(k8s, api, reconciler: Reconciler, body: dict) -> dict:
    """A new image, rolled out decode first (the test plays the StatefulSet controller)."""
    cluster = Cluster(k8s, api, reconciler)
    body["spec"]["image"]["tag"] = "0.2.0-cpu"
    await api.apply(body, field_manager="test-user")
    for _ in range(2):
        idep = await api.get("disagg.dev/v1alpha1", "InferenceDeployment", "default", "tiny")
        await reconciler.reconcile(idep, LOG)
        await cluster.mark_ready("StatefulSet", "tiny-decode")
        # No kopf runtime here: hand the reconciler the watch event a cluster would send.
        reconciler.children.seen(await api.get(*STS, "tiny-decode"))
    return idep


async def test_an_apply_that_drops_a_field_it_alone_owns_removes_it():
    async with emulated_api() as (_, api):
        sts = {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": "web", "namespace": "default", "labels": {"a": "1"}},
            "spec": {"replicas": 3, "serviceName": "web"},
        }
        await api.apply(sts, field_manager="one")
        without = {**sts, "spec": {"serviceName": "web"}}
        assert (await api.apply(without, field_manager="one"))["spec"]["replicas"] == 1  # reset, defaulted

        await api.apply(sts, field_manager="one")
        await api.apply(replicas.replicas_patch(sts, 3), field_manager="two")  # same value: co-owned
        assert replicas.managers_of(await api.get(*STS, "web"), "spec", "replicas") == {"one", "two"}
        assert (await api.apply(without, field_manager="one"))["spec"]["replicas"] == 3  # "two" keeps it

        forced = await api.apply(replicas.replicas_patch(sts, 4), field_manager="three")
        assert forced["spec"]["replicas"] == 4
        assert replicas.managers_of(forced, "spec", "replicas") == {"three"}  # forced: sole owner
        with pytest.raises(KubeError) as err:
            await api.apply(replicas.replicas_patch(sts, 5, resource_version="1"), field_manager="three")
        assert err.value.status == 409  # a stale resourceVersion


async def test_the_operator_creates_at_min_then_leaves_the_count_to_the_autoscaler():
    async with emulated_api() as (k8s, api):
        body, reconciler = await create_autoscaled(api, min_replicas=2)
        created = await prefill(api)
        assert created["spec"]["replicas"] == 2
        assert replicas.managers_of(created, "spec", "replicas") == {FIELD_MANAGER}

        # A template change before the autoscaler's first decision: handed over, then applied
        # without replicas; the pool keeps its 2 (without the hand-over it would fall to 1).
        idep = await change_template(k8s, api, reconciler, body)
        updated = await prefill(api)
        assert updated["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.2.0-cpu")
        assert updated["spec"]["replicas"] == 2
        assert replicas.managers_of(updated, "spec", "replicas") == {replicas.AUTOSCALER_MANAGER}

        # The autoscaler scales; a reconcile (the status says nothing of 4 here) writes nothing back.
        await ReplicaOwner(api).scale(updated, 4)
        outcome = await reconciler.reconcile(idep, LOG)
        assert "StatefulSet/tiny-prefill" not in outcome.applied
        assert (await prefill(api))["spec"]["replicas"] == 4


async def test_without_the_hand_over_the_emulator_catches_the_reset(monkeypatch):
    async with emulated_api() as (k8s, api):
        body, reconciler = await create_autoscaled(api, min_replicas=2)
        monkeypatch.setattr(replicas, "needs_handover", lambda live: False)
        await change_template(k8s, api, reconciler, body)
        assert (await prefill(api))["spec"]["template"]["spec"]["containers"][0]["image"].endswith(
            ":0.2.0-cpu"
        )
        assert (await prefill(api))["spec"]["replicas"] == 1


async def test_a_changed_count_is_restored_once_with_the_reason():
    async with emulated_api() as (_, api):
        await create_autoscaled(api, min_replicas=2)
        status = {"prefill": {"autoscaling": {"desiredReplicas": 3, "decisions": []}}}
        await api.patch_status("disagg.dev/v1alpha1", "InferenceDeployment", "default", "tiny", status)
        posted = []
        owner = ReplicaOwner(api, post=lambda obj, *event: posted.append(event))
        await owner.scale(await prefill(api), 3)
        assert await owner.revert_hand_edit("default", "tiny-prefill") is None  # nothing to undo

        edited = await prefill(api)
        edited["spec"]["replicas"] = 7
        await api.apply(edited, field_manager="kubectl")  # e.g. while the operator was down
        decision = await owner.revert_hand_edit("default", "tiny-prefill")
        assert (decision.previous, decision.replicas, decision.action) == (7, 3, "revert")
        assert (await prefill(api))["spec"]["replicas"] == 3
        assert replicas.managers_of(await prefill(api), "spec", "replicas") == {replicas.AUTOSCALER_MANAGER}
        (event,) = posted
        assert event[:2] == ("Warning", "ReplicasReverted") and "changed to 7" in event[2]
        idep = await api.get("disagg.dev/v1alpha1", "InferenceDeployment", "default", "tiny")
        (record,) = idep["status"]["prefill"]["autoscaling"]["decisions"]
        assert (record["from"], record["to"], record["code"]) == (7, 3, "ReplicasReverted")
        assert await owner.revert_hand_edit("default", "tiny-prefill") is None  # once
        assert len(posted) == 1


async def test_a_count_changed_before_the_first_decision_is_restored_not_adopted():
    """`kubectl scale` in the first seconds, before the autoscaler decided anything (its first tick
    found no StatefulSet yet): restored to the count the pool was created with, with the reason."""
    async with emulated_api() as (_, api):
        await create_autoscaled(api, min_replicas=2)
        posted = []
        owner = ReplicaOwner(api, post=lambda obj, *event: posted.append(event))
        assert await owner.revert_hand_edit("default", "tiny-prefill") is None  # as created: nothing to do

        await api.request(
            "PATCH",
            "/apis/apps/v1/namespaces/default/statefulsets/tiny-prefill",
            body={"spec": {"replicas": 5}},
            content_type="application/merge-patch+json",
            params={"fieldManager": "kubectl"},
        )
        decision = await owner.revert_hand_edit("default", "tiny-prefill")
        assert decision is not None and (decision.previous, decision.replicas) == (5, 2)
        assert (await prefill(api))["spec"]["replicas"] == 2
        (event,) = posted
        assert event[:2] == ("Warning", "ReplicasReverted") and "changed to 5" in event[2]
        idep = await api.get("disagg.dev/v1alpha1", "InferenceDeployment", "default", "tiny")
        assert idep["status"]["prefill"]["autoscaling"]["desiredReplicas"] == 2
