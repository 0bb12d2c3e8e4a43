"""Why pods do not run, read from the pods (pure), and the status and Events it gives a deployment
(the real kopf runtime against the emulated API: the pods are put there as kubelet would report them)."""

from __future__ import annotations

import datetime

import pytest
from kube_emulator import load_example
from test_operator_kmock import IDEP, condition, create, settle

from disagg.operator import constants as c
from disagg.operator import pod_health, status

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC).timestamp()


def stamp(seconds_ago: float) -> str:
    when = datetime.datetime.fromtimestamp(NOW - seconds_ago, datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(name: str, pod_status: dict, deployment: str = "tiny") -> dict:
    labels = {c.LABEL_DEPLOYMENT: deployment, c.LABEL_MANAGED_BY: c.FIELD_MANAGER}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": {"containers": [{"name": "worker", "image": "img"}]},
        "status": pod_status,
    }


UNSCHEDULABLE = {
    "phase": "Pending",
    "conditions": [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
        }
    ],
}


def waiting(reason: str, message: str = "", **extra) -> dict:
    return {
        "phase": "Pending",
        "containerStatuses": [
            {
                "name": "worker",
                "image": "ghcr.io/x/worker:nope",
                "state": {"waiting": {"reason": reason, "message": message}},
                **extra,
            }
        ],
    }


def running(ready_since: float | None) -> dict:
    cond = {"type": "Ready", "status": "True" if ready_since is None else "False"}
    if ready_since is not None:
        cond["lastTransitionTime"] = stamp(ready_since)
    return {
        "phase": "Running",
        "conditions": [cond],
        "containerStatuses": [{"name": "worker", "state": {"running": {}}}],
    }


CASES = [
    (
        UNSCHEDULABLE,
        "Unschedulable",
        "cannot be scheduled: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
    ),
    (
        waiting("ErrImagePull", "not found"),
        "ImagePullFailed",
        "cannot pull ghcr.io/x/worker:nope: ErrImagePull (not found)",
    ),
    (waiting("ImagePullBackOff"), "ImagePullFailed", "ImagePullBackOff"),
    (
        waiting(
            "CrashLoopBackOff",
            restartCount=4,
            lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}},
        ),
        "CrashLoopBackOff",
        "keeps restarting (4 restarts; last: OOMKilled, exit code 137)",
    ),
    (
        waiting("CreateContainerConfigError", 'secret "hf-token" not found'),
        "ContainerConfigError",
        'secret "hf-token" not found',
    ),
    (
        {"phase": "Failed", "reason": "Evicted", "message": "The node was low on memory."},
        "Evicted",
        "low on memory",
    ),
    (running(ready_since=601), "NotReady", "failing its readiness probe for 601 s"),
]


@pytest.mark.parametrize(("pod_status", "reason", "said"), CASES)
def test_each_reason_a_pod_does_not_run_is_named_with_the_pod(pod_status, reason, said):
    (found,) = pod_health.problems([pod("tiny-decode-0", pod_status)], NOW, 600)
    assert found.reason == reason and found.pod == "tiny-decode-0"
    assert said in found.message
    assert found.describe().startswith("pod tiny-decode-0: ")


@pytest.mark.parametrize(
    "pod_status",
    [
        running(ready_since=None),  # ready
        running(ready_since=599),  # still within the grace a large checkpoint's load needs
        waiting("ContainerCreating"),
        {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]},
        {},
    ],
)
def test_pods_on_their_way_are_no_problem(pod_status):
    assert pod_health.problems([pod("tiny-decode-0", pod_status)], NOW, 600) == []


def test_a_pod_being_deleted_is_not_judged():
    going = pod("tiny-decode-0", UNSCHEDULABLE)
    going["metadata"]["deletionTimestamp"] = stamp(1)
    assert pod_health.problems([going], NOW, 600) == []


def test_the_most_urgent_problem_comes_first_and_the_message_stays_short():
    pods = [pod("tiny-prefill-0", running(ready_since=900)), pod("tiny-decode-1", waiting("ErrImagePull"))]
    pods += [pod(f"tiny-decode-{i}", UNSCHEDULABLE) for i in range(2, 9)]
    found = pod_health.problems(pods, NOW, 600)
    assert [p.reason for p in found[:7]] == ["Unschedulable"] * 7
    assert found[7].reason == "ImagePullFailed" and found[8].reason == "NotReady"
    message = status.pods_message(found)
    assert message.count("pod tiny-decode-") == status.MAX_PODS_NAMED and message.endswith("and 4 more")


async def test_an_unschedulable_pod_degrades_the_deployment_names_it_and_posts_one_event(cluster):
    await create(cluster, load_example("cpu-tiny.yaml"))
    await settle(cluster)
    cluster.k8s.objects["v1/pods", "default", "tiny-decode-0"] = pod("tiny-decode-0", UNSCHEDULABLE)
    await cluster.mark_ready("StatefulSet", "tiny-decode", ready=0)
    degraded = await cluster.eventually(
        lambda: (
            (d := condition(cluster.live(IDEP, "tiny"), "Degraded")).get("reason") == "Unschedulable" and d
        ),
        what="Degraded=True, reason Unschedulable",
    )
    assert degraded["status"] == "True"
    assert degraded["message"] == (
        "pod tiny-decode-0: cannot be scheduled: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    )
    # Another reconcile (prefill lost a pod too) sees the same problem: no second Event.
    await cluster.mark_ready("StatefulSet", "tiny-prefill", ready=0)
    await cluster.eventually(
        lambda: cluster.live(IDEP, "tiny")["status"]["prefill"]["ready"] == "0/1", what="the next run"
    )
    posted = [e for e in cluster.events() if e.get("reason") == "Unschedulable"]
    assert len(posted) == 1 and posted[0]["type"] == "Warning"
    assert "tiny-decode-0" in posted[0]["message"]

    del cluster.k8s.objects["v1/pods", "default", "tiny-decode-0"]
    await cluster.mark_ready("StatefulSet", "tiny-decode")
    await cluster.mark_ready("StatefulSet", "tiny-prefill")
    await cluster.eventually(
        lambda: condition(cluster.live(IDEP, "tiny"), "Degraded").get("status") == "False",
        what="Degraded=False once the pod runs",
    )
