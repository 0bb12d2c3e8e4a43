"""The operator end to end: real kopf runtime, our handlers, an in-memory Kubernetes API."""

from __future__ import annotations

import logging

import pytest
from kube_emulator import load_example

from disagg.operator import constants as c
from disagg.worker.serving.process_args import WorkerProcessArgs

IDEP = "disagg.dev/v1alpha1/inferencedeployments"
STS = "apps/v1/statefulsets"
DEPLOY = "apps/v1/deployments"
LOG = logging.getLogger("test")


def condition(obj: dict | None, ctype: str) -> dict:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return cond
    return {}


def container(sts: dict) -> dict:
    return sts["spec"]["template"]["spec"]["containers"][0]


async def create(cluster, body: dict) -> None:
    await cluster.api.apply(body, field_manager="test-user")


async def settle(cluster, name: str = "tiny") -> None:
    """Wait for the children, then report every workload rolled out and ready."""
    await cluster.eventually(
        lambda: cluster.live("policy/v1/poddisruptionbudgets", f"{name}-router"), what="all children"
    )
    for kind, child in (
        ("StatefulSet", f"{name}-decode"),
        ("StatefulSet", f"{name}-prefill"),
        ("Deployment", f"{name}-router"),
        ("StatefulSet", f"{name}-redis"),
    ):
        await cluster.mark_ready(kind, child)
    await cluster.eventually(
        lambda: (
            condition(cluster.live(IDEP, name), "Ready").get("status") == "True"
            and condition(cluster.live(IDEP, name), "Degraded").get("status") == "False"
        ),
        what="Ready=True, Degraded=False",
    )


async def test_create_makes_children_with_roles_owners_and_images(cluster):
    await create(cluster, load_example("cpu-tiny.yaml"))
    await cluster.eventually(
        lambda: cluster.live("policy/v1/poddisruptionbudgets", "tiny-router"), what="children"
    )
    for role in c.ROLES:
        sts = cluster.live(STS, f"tiny-{role}")
        assert sts["metadata"]["labels"][c.LABEL_ROLE] == role
        assert sts["spec"]["template"]["metadata"]["labels"][c.LABEL_ROLE] == role
        owner = sts["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "InferenceDeployment",
            "tiny",
            "uid-1",
            True,
        )
        main = container(sts)
        assert main["image"] == "ghcr.io/disagg/disagg-worker:0.1.0-cpu"
        args = main["args"]
        assert args[args.index(WorkerProcessArgs.cli_flag("role")) + 1] == role
        assert {"name": "DISAGG_ROLE", "value": role} in main["env"]
        assert cluster.live("v1/services", f"tiny-{role}")["spec"]["clusterIP"] == "None"
    for resource, name in (
        ("v1/services", "tiny"),
        ("v1/configmaps", "tiny-config"),
        ("v1/serviceaccounts", "tiny"),
        (STS, "tiny-redis"),
        ("policy/v1/poddisruptionbudgets", "tiny-decode"),
    ):
        assert cluster.live(resource, name) is not None, (resource, name)
    await cluster.eventually(lambda: cluster.live(IDEP, "tiny").get("status"), what="status")
    status = cluster.live(IDEP, "tiny")["status"]
    assert status["endpoint"] == "http://tiny.default.svc:8000/v1"
    assert condition(cluster.live(IDEP, "tiny"), "Ready")["status"] == "False"
    assert condition(cluster.live(IDEP, "tiny"), "Progressing")["status"] == "True"
    await cluster.eventually(lambda: "Created" in {e.get("reason") for e in cluster.events()}, what="events")


async def test_status_follows_readiness_and_repeat_runs_change_nothing(cluster):
    await create(cluster, load_example("cpu-tiny.yaml"))
    await settle(cluster)
    idep = cluster.live(IDEP, "tiny")
    assert idep["status"]["prefill"]["ready"] == "1/1"
    assert condition(idep, "Progressing")["status"] == "False"
    assert condition(idep, "Degraded")["status"] == "False"

    # A resume or repeated run: nothing applied, nothing in the status moves.
    outcome = await cluster.reconciler.reconcile(cluster.live(IDEP, "tiny"), LOG)
    assert outcome.applied == []
    after = cluster.live(IDEP, "tiny")["status"]
    assert after == idep["status"]

    await cluster.mark_ready("StatefulSet", "tiny-decode", ready=0)
    await cluster.eventually(
        lambda: condition(cluster.live(IDEP, "tiny"), "Ready").get("status") == "False",
        what="Ready=False after decode lost its pods",
    )
    assert cluster.live(IDEP, "tiny")["status"]["decode"]["ready"] == "0/1"


async def test_spec_change_updates_decode_first_then_prefill(cluster):
    body = load_example("cpu-tiny.yaml")
    await create(cluster, body)
    await settle(cluster)

    body["spec"]["image"]["tag"] = "0.2.0-cpu"
    body["spec"]["prefill"]["replicas"] = 2
    await cluster.api.apply(body, field_manager="test-user")
    new_image = "ghcr.io/disagg/disagg-worker:0.2.0-cpu"
    await cluster.eventually(
        lambda: container(cluster.live(STS, "tiny-decode"))["image"] == new_image, what="decode updated"
    )
    await cluster.eventually(
        lambda: condition(cluster.live(IDEP, "tiny"), "Progressing").get("reason") == "WaitingForDecode",
        what="prefill held",
    )
    assert container(cluster.live(STS, "tiny-prefill"))["image"] != new_image
    assert condition(cluster.live(IDEP, "tiny"), "Ready")["status"] == "False"

    await cluster.mark_ready("StatefulSet", "tiny-decode")
    await cluster.eventually(
        lambda: container(cluster.live(STS, "tiny-prefill"))["image"] == new_image,
        what="prefill updated after decode rolled out",
    )
    assert cluster.live(STS, "tiny-prefill")["spec"]["replicas"] == 2
    await cluster.eventually(
        lambda: "RolloutHeld" in {e.get("reason") for e in cluster.events()}, what="RolloutHeld event"
    )


async def test_child_deleted_by_hand_is_recreated(cluster):
    await create(cluster, load_example("cpu-tiny.yaml"))
    await settle(cluster)
    await cluster.api.delete("apps/v1", "StatefulSet", "default", "tiny-decode")
    await cluster.eventually(lambda: cluster.live(STS, "tiny-decode"), what="decode recreated")
    await cluster.eventually(
        lambda: "Recreated" in {e.get("reason") for e in cluster.events()}, what="Recreated event"
    )
    await cluster.eventually(
        lambda: condition(cluster.live(IDEP, "tiny"), "Ready").get("status") == "False",
        what="not Ready while the new decode pods start",
    )


async def test_invalid_spec_is_reported_and_builds_nothing(cluster):
    body = load_example("cpu-tiny.yaml")
    body["spec"]["decode"]["autoscaling"] = {
        "minReplicas": 1,
        "maxReplicas": 2,
        "target": {"itlMilliseconds": 50},
    }
    await create(cluster, body)
    await cluster.eventually(
        lambda: condition(cluster.live(IDEP, "tiny"), "Degraded").get("reason") == "InvalidSpec",
        what="InvalidSpec",
    )
    message = condition(cluster.live(IDEP, "tiny"), "Degraded")["message"]
    assert message.startswith("spec.decode: ")
    assert cluster.live(STS, "tiny-decode") is None
    # Nothing is being rolled out: Progressing says so rather than "creating decode, prefill, router".
    progressing = condition(cluster.live(IDEP, "tiny"), "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "InvalidSpec")


@pytest.mark.parametrize("jobs_served", [True, False])
async def test_delete_runs_finalizer_and_schedules_the_redis_cleanup_job(cluster, jobs_served):
    """The operator never connects to Redis (that needs the password): for an external Redis the
    finalizer starts the cleanup Job (whose `disagg cleanup` the contract suite runs for real)."""
    if not jobs_served:  # e.g. RBAC without `create jobs`: the API server refuses the Job
        cluster.k8s.forbidden.add(("create", "jobs"))
    body = load_example("cpu-tiny.yaml")
    body["spec"]["redis"] = {
        "external": {"url": "redis://cache.infra:6379/1", "passwordSecret": {"name": "redis-auth"}}
    }
    await create(cluster, body)
    await cluster.eventually(
        lambda: c.FINALIZER in (cluster.live(IDEP, "tiny") or {}).get("metadata", {}).get("finalizers", []),
        what="finalizer added",
    )
    assert cluster.live(STS, "tiny-redis") is None  # external Redis: none managed

    await cluster.api.delete(c.API_VERSION, c.KIND, "default", "tiny")
    await cluster.eventually(lambda: cluster.live(IDEP, "tiny") is None, what="deletion finished")
    job = cluster.live("batch/v1/jobs", "tiny-cleanup-uid-1")
    if not jobs_served:
        assert job is None
        await cluster.eventually(
            lambda: "CleanupSkipped" in {e.get("reason") for e in cluster.events()},
            what="CleanupSkipped event",
        )
        return
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == [
        "disagg", "cleanup", *WorkerProcessArgs.cli_args(redis_url="redis://cache.infra:6379/1", deployment="default.tiny")
    ]  # fmt: skip
    assert {
        "name": "DISAGG_REDIS_PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "password"}},
    } in container["env"]
    assert "ownerReferences" not in job["metadata"] and job["spec"]["ttlSecondsAfterFinished"] > 0
    await cluster.eventually(
        lambda: "CleanupScheduled" in {e.get("reason") for e in cluster.events()}, what="CleanupScheduled"
    )


async def test_hand_scaled_pool_is_reverted_with_a_reason(cluster):
    await create(cluster, load_example("cpu-tiny.yaml"))
    await settle(cluster)
    sts = cluster.live(STS, "tiny-prefill")
    sts["spec"]["replicas"] = 5
    await cluster.api.apply(sts, field_manager="kubectl")
    await cluster.eventually(
        lambda: cluster.live(STS, "tiny-prefill")["spec"]["replicas"] == 1, what="replicas reverted"
    )
    await cluster.eventually(
        lambda: any(
            e.get("reason") == "ReplicasReverted" and "5 -> 1" in e.get("message", "")
            for e in cluster.events()
        ),
        what="ReplicasReverted event",
    )


async def test_host_path_source_is_refused_by_default_naming_the_field(cluster):
    body = load_example("cpu-tiny.yaml")
    body["spec"]["model"]["source"] = {"hostPath": {"path": "/var/lib/kubelet"}}
    await create(cluster, body)
    await cluster.eventually(
        lambda: condition(cluster.live(IDEP, "tiny"), "Degraded").get("reason") == "InvalidSpec",
        what="Degraded",
    )
    assert condition(cluster.live(IDEP, "tiny"), "Degraded")["message"].startswith(
        "spec.model.source.hostPath.path: '/var/lib/kubelet' is not allowed"
    )
    assert cluster.live(STS, "tiny-decode") is None and cluster.live(DEPLOY, "tiny-router") is None


async def test_credentials_secret_is_created_once_and_never_read(cluster):
    await create(cluster, load_example("cpu-tiny.yaml"))
    await settle(cluster)
    secret = cluster.live("v1/secrets", "tiny-credentials")
    assert set(secret["stringData"]) == {"internal-token", "redis-password"}
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    # A spec change reconciles again: the Secret keeps its values (create-only), nothing reads it.
    body = load_example("cpu-tiny.yaml")
    body["spec"]["decode"]["replicas"] = 2
    await create(cluster, body)
    await cluster.eventually(lambda: cluster.live(STS, "tiny-decode")["spec"]["replicas"] == 2, what="scaled")
    assert cluster.live("v1/secrets", "tiny-credentials")["stringData"] == secret["stringData"]
    secret_calls = {v for client, _, r, v in cluster.k8s.calls if r == "secrets"}
    assert secret_calls == {"create"}
