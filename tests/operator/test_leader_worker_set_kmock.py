"""The operator with a role spanning nodes, against the emulated API: with the LeaderWorkerSet API
served it creates the LWS (not the role's StatefulSet), reports its readiness, and swaps it back for
a StatefulSet when the role fits a node again; without the API the status names the field."""

from __future__ import annotations

import pytest
from kube_emulator import LEADER_WORKER_SETS, load_example, running_operator
from test_operator_kmock import IDEP, STS, condition

LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"


def _spanning(tp: int = 16) -> dict:
    body = load_example("cpu-tiny.yaml")
    body["spec"]["decode"].update(tensorParallelSize=tp)
    body["spec"]["decode"]["resources"] = {"limits": {"memory": "96Gi", "nvidia.com/gpu": min(tp, 8)}}
    return body


@pytest.fixture
async def lws_cluster():
    async with running_operator(extra_resources=LEADER_WORKER_SETS) as cluster:
        yield cluster


async def test_a_role_spanning_nodes_runs_as_a_leader_worker_set_and_back(lws_cluster):
    cluster = lws_cluster
    body = _spanning()
    await cluster.api.apply(body, field_manager="test-user")
    lws = await cluster.eventually(lambda: cluster.live(LWS, "tiny-decode-lws"), what="the LWS")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2 and lws["spec"]["replicas"] == 1
    await cluster.eventually(lambda: cluster.live(STS, "tiny-prefill"), what="prefill")
    assert cluster.live(STS, "tiny-decode") is None
    # the LWS controller's part: every group rolled out and ready
    await cluster.api.patch_status(
        "leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "default", "tiny-decode-lws",
        {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
    )  # fmt: skip
    for kind, name in (
        ("StatefulSet", "tiny-prefill"),
        ("Deployment", "tiny-router"),
        ("StatefulSet", "tiny-redis"),
    ):
        await cluster.mark_ready(kind, name)
    await cluster.eventually(
        lambda: condition(cluster.live(IDEP, "tiny"), "Ready").get("status") == "True", what="Ready"
    )
    assert cluster.live(IDEP, "tiny")["status"]["decode"]["ready"] == "1/1"

    body["spec"]["decode"]["replicas"] = 3  # replicas act on the LWS's groups
    await cluster.api.apply(body, field_manager="test-user")
    await cluster.eventually(lambda: cluster.live(LWS, "tiny-decode-lws")["spec"]["replicas"] == 3, what="3")

    await cluster.api.apply(_spanning(tp=8), field_manager="test-user")  # fits a node again
    await cluster.eventually(
        lambda: cluster.live(STS, "tiny-decode") is not None and cluster.live(LWS, "tiny-decode-lws") is None,
        what="the StatefulSet back, the LWS pruned",
    )


async def test_without_the_leader_worker_set_api_the_status_names_the_field(cluster):
    await cluster.api.apply(_spanning(), field_manager="test-user")
    degraded = await cluster.eventually(
        lambda: condition(cluster.live(IDEP, "tiny"), "Degraded") or None, what="a Degraded condition"
    )
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert degraded["message"].startswith("spec.decode.tensorParallelSize: is 16")
    assert "does not serve leaderworkerset.x-k8s.io/v1" in degraded["message"]
    assert cluster.live(STS, "tiny-decode") is None
