"""The operator on a real API server: the chart installed with Helm's library, `disagg operator` running
with the chart ServiceAccount's token (not an admin's), and the CPU example created, scaled, edited,
hand-edited, pruned, autoscaled, refused and deleted.

Needs DISAGG_TEST_KUBECONFIG (an admin's kubeconfig); everything lives in a throwaway namespace.
Pods need not run (the suite's control plane marks them Running without containers): the checks
are on objects, status, Events, ownership and garbage collection. Whatever comes back within
seconds comes back through a watch: the operator's resync is set ten minutes away.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import pathlib
import re
import time

import helm_python as helm
import pytest
import yaml
from cluster import (
    CHART,
    IDEP,
    RELEASE,
    SERVICE_MONITOR_CRD,
    USER,
    admin_kubeconfig,
    chart_values,
    client,
    condition,
    eventually,
    example,
    fake_prometheus,
    helm_config,
    new_namespace,
    reasons,
    service_account_kubeconfig,
    start_operator,
    stop,
)

from disagg.operator.kube import KubeError

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
STS = ("apps/v1", "StatefulSet")


@dataclasses.dataclass
class Installed:
    namespace: str
    kubeconfig: pathlib.Path  # the chart ServiceAccount's
    log: pathlib.Path
    upgraded: dict


RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


async def _setup(namespace: str, tmp: pathlib.Path) -> tuple[pathlib.Path, bool]:
    admin = client(admin_kubeconfig())
    try:
        # Pod Security admission refuses, in this namespace, any pod that is not `restricted`.
        await admin.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}",
            body={"metadata": {"labels": RESTRICTED}},
            content_type="application/merge-patch+json",
        )
        # A ServiceMonitor CRD, unless the cluster has the Prometheus Operator's: the pruning of a
        # ServiceMonitor needs the kind to exist. Removed afterwards only if installed here.
        ours = not await admin.serves("monitoring.coreos.com/v1", "servicemonitors")
        if ours:
            await admin.apply(SERVICE_MONITOR_CRD, field_manager=USER)
            await eventually(
                lambda: admin.serves("monitoring.coreos.com/v1", "servicemonitors"), 30, "SM CRD"
            )
        return await service_account_kubeconfig(admin, namespace, tmp / "operator.kubeconfig"), ours
    finally:
        await admin.close()


async def _delete_resources(namespace: str) -> None:
    """Delete every InferenceDeployment while the operator still runs: their finalizer needs it, and
    the namespace could not go away with them in it."""
    admin = client(admin_kubeconfig())
    try:
        for item in await admin.list(*IDEP, namespace, ""):
            await admin.delete(*IDEP, namespace, item["metadata"]["name"])

        async def none_left():
            return not await admin.list(*IDEP, namespace, "")

        await eventually(none_left, 60, "every InferenceDeployment deleted")
    finally:
        await admin.close()


async def _teardown(namespace: str, service_monitor_crd: bool) -> None:
    admin = client(admin_kubeconfig())
    try:
        await admin.delete("v1", "Namespace", None, namespace)
        if service_monitor_crd:
            await admin.delete(
                "apiextensions.k8s.io/v1",
                "CustomResourceDefinition",
                None,
                SERVICE_MONITOR_CRD["metadata"]["name"],
            )
    finally:
        await admin.close()


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    namespace = new_namespace()
    tmp = tmp_path_factory.mktemp("cluster")
    with helm.Chart.load(CHART) as chart, helm_config(namespace) as cfg:
        release = cfg.install(chart, RELEASE, chart_values(namespace), create_namespace=True, timeout=120)
        assert (release["status"], release["revision"]) == ("deployed", 1)
        upgraded = cfg.upgrade(chart, RELEASE, chart_values(namespace, resyncSeconds=45), timeout=120)
        kubeconfig, sm_crd = asyncio.run(_setup(namespace, tmp))
        log = tmp / "operator.log"
        proc = start_operator(kubeconfig, namespace, log)
        try:
            yield Installed(namespace, kubeconfig, log, upgraded)
        finally:
            asyncio.run(_delete_resources(namespace))
            stop(proc)
            text = log.read_text()
            cfg.uninstall(RELEASE, timeout=120)
            asyncio.run(_teardown(namespace, sm_crd))
    # The operator never met a refusal: its RBAC covers every call it made.
    assert not re.search(r"\b403\b|Forbidden", text), text[-3000:]


@pytest.fixture
async def kube():
    admin = client(admin_kubeconfig())
    yield admin
    await admin.close()


@pytest.fixture
def ns(installed) -> str:
    return installed.namespace


async def create(kube, body: dict) -> None:
    await kube.apply(body, field_manager=USER)


async def sts(kube, ns: str, name: str) -> dict | None:
    return await kube.get(*STS, ns, name)


def image(obj: dict) -> str:
    return obj["spec"]["template"]["spec"]["containers"][0]["image"]


async def ready(kube, ns: str, name: str) -> None:
    """Children built and the resource Ready (pods marked running by the control plane)."""

    async def is_ready():
        idep = await kube.get(*IDEP, ns, name)
        return condition(idep, "Ready").get("status") == "True"

    await eventually(is_ready, 90, f"{name} Ready")


async def _scale(kube, ns: str, name: str, replicas: int, manager: str = "kubectl") -> None:
    """`kubectl scale`: the scale subresource, as another field manager."""
    await kube.request(
        "PATCH",
        f"/apis/apps/v1/namespaces/{ns}/statefulsets/{name}/scale",
        body={"spec": {"replicas": replicas}},
        content_type="application/merge-patch+json",
        params={"fieldManager": manager},
    )


# ---- install ------------------------------------------------------------------------------------


async def test_the_chart_installs_and_upgrades_with_helms_library(installed, kube):
    assert installed.upgraded["status"] == "deployed"
    deploy = await kube.get("apps/v1", "Deployment", installed.namespace, RELEASE)
    assert "--resync-seconds=45" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    crd = await kube.get(
        "apiextensions.k8s.io/v1", "CustomResourceDefinition", None, "inferencedeployments.disagg.dev"
    )
    established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert established["Established"] == "True" and established["NamesAccepted"] == "True"


def test_a_second_release_installs_upgrades_and_uninstalls():
    namespace = new_namespace()
    with helm.Chart.load(CHART) as chart, helm_config(namespace) as cfg:
        cfg.install(chart, "disagg-second", chart_values(namespace), create_namespace=True, timeout=120)
        cfg.upgrade(chart, "disagg-second", chart_values(namespace, verbose=True), timeout=120)
        assert [r["revision"] for r in cfg.history("disagg-second")] == [1, 2]
        cfg.uninstall("disagg-second", timeout=120)
        assert cfg.list(all_states=True) == []

    async def gone():
        admin = client(admin_kubeconfig())
        try:
            role = await admin.get("rbac.authorization.k8s.io/v1", "ClusterRole", None, "disagg-second")
            sa = await admin.get("v1", "ServiceAccount", namespace, "disagg-second")
            await admin.delete("v1", "Namespace", None, namespace)
            return role, sa
        finally:
            await admin.close()

    assert asyncio.run(gone()) == (None, None)


async def test_the_operator_runs_as_the_chart_service_account_not_an_admin(installed):
    operator = client(str(installed.kubeconfig))
    try:
        review = await operator.request(
            "POST",
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        )
        assert (
            review["status"]["userInfo"]["username"]
            == f"system:serviceaccount:{installed.namespace}:{RELEASE}"
        )
        for verb, resource, namespace in (
            ("create", "namespaces", None),
            ("list", "secrets", "default"),
            ("get", "secrets", installed.namespace),
            ("list", "secrets", installed.namespace),
            ("watch", "secrets", installed.namespace),
        ):
            access = await operator.request(
                "POST",
                "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                body={
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SelfSubjectAccessReview",
                    "spec": {
                        "resourceAttributes": {"verb": verb, "resource": resource, "namespace": namespace}
                    },
                },
            )
            assert access["status"]["allowed"] is False, (verb, resource)
    finally:
        await operator.close()


# ---- the CPU example ------------------------------------------------------------------------------


async def test_cpu_example_is_created_scaled_and_edited_decode_first(kube, ns):
    body = example("life", ns)
    await create(kube, body)
    await ready(kube, ns, "life")
    idep = await kube.get(*IDEP, ns, "life")
    assert "disagg.dev/finalizer" in idep["metadata"]["finalizers"]
    assert idep["status"]["endpoint"] == f"http://life.{ns}.svc:8000/v1"
    for kind, name in (
        ("StatefulSet", "life-decode"),
        ("StatefulSet", "life-prefill"),
        ("Deployment", "life-router"),
    ):
        child = await kube.get("apps/v1", kind, ns, name)
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["uid"], owner["controller"]) == (idep["metadata"]["uid"], True)

    # Admitted where Pod Security enforces `restricted`: every workload's pods were created.
    namespace = await kube.get("v1", "Namespace", None, ns)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    pods = await kube.list("v1", "Pod", ns, "disagg.dev/deployment=life")
    components = {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods}
    assert components == {"decode", "prefill", "router", "redis"}, components
    refused = [
        e for e in (await kube.request("GET", f"/api/v1/namespaces/{ns}/events")).get("items", [])
        if "PodSecurity" in e.get("message", "")
    ]  # fmt: skip
    assert refused == [], refused[0]["message"]
    # The NetworkPolicies, accepted by the API server's validation.
    for part in ("router", "workers", "redis"):
        policy = await kube.get("networking.k8s.io/v1", "NetworkPolicy", ns, f"life-{part}")
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"], part
    # The generated credentials: created by the operator, which cannot read them back.
    secret = await kube.get("v1", "Secret", ns, "life-credentials")
    assert set(secret["data"]) == {"internal-token", "redis-password"}
    assert secret["metadata"]["ownerReferences"][0]["uid"] == idep["metadata"]["uid"]

    # Scaled through the spec: a Scaled Event, not a revert.
    body["spec"]["decode"]["replicas"] = 2
    await create(kube, body)
    await eventually(lambda: _replicas(kube, ns, "life-decode", 2), 30, "decode scaled to 2")
    scaled = await eventually(lambda: reasons(kube, ns, "life", "Scaled"), 15, "the Scaled Event")
    assert "life-decode from 1 to 2" in scaled[0]["message"]
    assert await reasons(kube, ns, "life", "ReplicasReverted") == []

    # A new image: decode rolls out first; prefill follows once decode's pods run it.
    await ready(kube, ns, "life")
    body["spec"]["image"]["tag"] = "0.2.0-cpu"
    await create(kube, body)
    changed: dict[str, float] = {}
    deadline = time.monotonic() + 90
    while len(changed) < 2 and time.monotonic() < deadline:
        for role in ("decode", "prefill"):
            if role not in changed and image(await sts(kube, ns, f"life-{role}")).endswith(":0.2.0-cpu"):
                changed[role] = time.monotonic()
        await asyncio.sleep(0.1)
    assert changed.keys() == {"decode", "prefill"} and changed["decode"] < changed["prefill"], changed
    assert await reasons(kube, ns, "life", "RolloutHeld")
    await ready(kube, ns, "life")


async def _replicas(kube, ns: str, name: str, want: int) -> bool:
    found = await sts(kube, ns, name)
    return found is not None and found["spec"].get("replicas") == want


async def test_hand_edits_are_reverted_with_one_event_each(kube, ns):
    await create(kube, example("hand", ns))
    await ready(kube, ns, "hand")

    await _scale(kube, ns, "hand-decode", 4)
    await eventually(lambda: _replicas(kube, ns, "hand-decode", 1), 15, "replicas restored")
    await asyncio.sleep(3)  # nothing more comes
    (reverted,) = await reasons(kube, ns, "hand", "ReplicasReverted")
    assert "hand-decode replicas 4 -> 1" in reverted["message"] and reverted["type"] == "Warning"

    live = await sts(kube, ns, "hand-decode")
    original = image(live)
    container = copy.deepcopy(live["spec"]["template"]["spec"]["containers"][0])
    container["image"] = "registry.example/other:1"
    await kube.request(
        "PATCH",
        f"/apis/apps/v1/namespaces/{ns}/statefulsets/hand-decode",
        body={"spec": {"template": {"spec": {"containers": [container]}}}},
        content_type="application/strategic-merge-patch+json",
        params={"fieldManager": "kubectl-set"},
    )

    async def restored():
        return image(await sts(kube, ns, "hand-decode")) == original

    await eventually(restored, 15, "image restored")
    await asyncio.sleep(3)
    (drift,) = await reasons(kube, ns, "hand", "DriftReverted")
    assert "containers[worker].image" in drift["message"]
    assert len(await reasons(kube, ns, "hand", "ReplicasReverted")) == 1


async def test_deleted_children_come_back_within_seconds(kube, ns):
    await create(kube, example("gone", ns))
    await ready(kube, ns, "gone")
    for api_version, kind, name in (
        ("policy/v1", "PodDisruptionBudget", "gone-decode"),
        ("v1", "Service", "gone"),
        ("v1", "ConfigMap", "gone-config"),
        ("apps/v1", "StatefulSet", "gone-prefill"),
        ("apps/v1", "Deployment", "gone-router"),
    ):
        old = await kube.get(api_version, kind, ns, name)
        await kube.delete(api_version, kind, ns, name)
        started = time.monotonic()

        async def back(a=api_version, k=kind, n=name, uid=old["metadata"]["uid"]):
            found = await kube.get(a, k, ns, n)
            return found is not None and found["metadata"]["uid"] != uid

        await eventually(back, 10, f"{kind} {name} recreated", interval=0.2)
        assert time.monotonic() - started < 10


# ---- pruning ----------------------------------------------------------------------------------------


async def _prune(kube, ns: str, name: str, body: dict, change, gone: list[tuple[str, str, str]]) -> None:
    await create(kube, body)
    for api_version, kind, child in gone:
        await eventually(lambda a=api_version, k=kind, c=child: kube.get(a, k, ns, c), 30, f"{kind} {child}")
    change(body["spec"])
    await create(kube, body)
    for api_version, kind, child in gone:

        async def pruned(a=api_version, k=kind, c=child):
            return await kube.get(a, k, ns, c) is None

        await eventually(pruned, 15, f"{kind} {child} pruned")
    events = await eventually(lambda: reasons(kube, ns, name, "Pruned"), 10, "Pruned Events")
    assert {e["message"].split(":")[0] for e in events} == {f"deleted {k} {c}" for _, k, c in gone}


async def test_hpa_to_operator_mode_prunes_the_hpa(kube, ns):
    body = example("hpa2op", ns)
    del body["spec"]["prefill"]["replicas"]
    body["spec"]["prefill"]["autoscaling"] = {
        "maxReplicas": 3,
        "target": {"ttftMilliseconds": 500},
        "mode": "hpa",
    }
    gone = [("autoscaling/v2", "HorizontalPodAutoscaler", "hpa2op-prefill")]
    await _prune(
        kube, ns, "hpa2op", body, lambda s: s["prefill"]["autoscaling"].update(mode="operator"), gone
    )
    assert await sts(kube, ns, "hpa2op-prefill") is not None


async def test_managed_to_external_redis_prunes_the_managed_redis(kube, ns):
    gone = [
        ("apps/v1", "StatefulSet", "ext-redis"),
        ("v1", "Service", "ext-redis"),
        ("networking.k8s.io/v1", "NetworkPolicy", "ext-redis"),  # the managed Redis' own policy
    ]
    # Nothing listens there: the finalizer's key cleanup finds it unreachable at once.
    change = lambda s: s.update(redis={"external": {"url": "redis://127.0.0.1:1/0"}})  # noqa: E731
    await _prune(kube, ns, "ext", example("ext", ns), change, gone)


async def test_turning_the_service_monitor_off_prunes_it(kube, ns):
    gone = [("monitoring.coreos.com/v1", "ServiceMonitor", "mon")]
    change = lambda s: s.update(monitoring={"serviceMonitor": False})  # noqa: E731
    await _prune(kube, ns, "mon", example("mon", ns), change, gone)


# ---- autoscaling ---------------------------------------------------------------------------------


async def test_operator_mode_scales_on_the_metrics_and_owns_the_count(kube, ns):
    async with fake_prometheus() as prom:
        body = example("auto", ns)
        del body["spec"]["prefill"]["replicas"]
        body["spec"]["prefill"]["autoscaling"] = {
            "minReplicas": 1,
            "maxReplicas": 3,
            "target": {"ttftMilliseconds": 500},
            "scaleDown": {"stabilizationSeconds": 1},
            "metricsUrl": f"http://127.0.0.1:{prom.port}",
        }
        await create(kube, body)  # TTFT 2 s against 500 ms: up to maxReplicas
        await eventually(lambda: _replicas(kube, ns, "auto-prefill", 3), 90, "prefill at maxReplicas")
        idep = await kube.get(*IDEP, ns, "auto")
        assert idep["status"]["prefill"]["autoscaling"]["desiredReplicas"] == 3
        assert prom.queries > 0

        await _scale(kube, ns, "auto-prefill", 1)  # a hand edit: the autoscaler owns the count
        await eventually(lambda: _replicas(kube, ns, "auto-prefill", 3), 30, "hand edit undone")
        (reverted,) = await eventually(
            lambda: reasons(kube, ns, "auto", "ReplicasReverted"), 10, "revert Event"
        )
        assert "restored 3" in reverted["message"]

        prom.ttft_seconds = 0.05  # well within target: down, one step at a time, to minReplicas
        await eventually(lambda: _replicas(kube, ns, "auto-prefill", 1), 120, "prefill back at minReplicas")
        decisions = (await kube.get(*IDEP, ns, "auto"))["status"]["prefill"]["autoscaling"]["decisions"]
        assert [(d["from"], d["to"]) for d in decisions if d["action"] == "down"][-2:] == [(3, 2), (2, 1)]


async def test_hpa_mode_hands_the_count_to_the_hpa(kube, ns):
    body = example("hpa", ns)
    del body["spec"]["decode"]["replicas"]
    body["spec"]["decode"]["autoscaling"] = {
        "minReplicas": 2,
        "maxReplicas": 4,
        "target": {"itlMilliseconds": 40},
        "mode": "hpa",
    }
    await create(kube, body)
    hpa = await eventually(
        lambda: kube.get("autoscaling/v2", "HorizontalPodAutoscaler", ns, "hpa-decode"), 30, "the HPA"
    )
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "hpa-decode",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 4)
    await eventually(lambda: _replicas(kube, ns, "hpa-decode", 2), 30, "created at minReplicas")
    # A scale by the HPA (its own field manager) stays: the operator leaves the count alone.
    await _scale(kube, ns, "hpa-decode", 3, manager="horizontal-pod-autoscaler")
    await asyncio.sleep(5)
    assert await _replicas(kube, ns, "hpa-decode", 3)
    assert await reasons(kube, ns, "hpa", "ReplicasReverted") == []


# ---- refusal and deletion ---------------------------------------------------------------------------


async def test_an_invalid_spec_is_refused_naming_the_field(kube, ns):
    body = example("bad", ns)
    body["spec"]["decode"]["autoscaling"] = {"maxReplicas": 2, "target": {"itlMilliseconds": 50}}
    with pytest.raises(KubeError) as err:  # the API server's CEL rule, at admission
        await create(kube, body)
    assert err.value.status == 422 and "set exactly one of replicas and autoscaling" in str(err.value)

    body = example("bad", ns)
    body["spec"]["prefill"]["tensorParallelSize"] = 2  # admitted, but its ranks move KV over NIXL only
    body["spec"]["kvTransfer"] = {"backend": "grpc"}
    await create(kube, body)

    async def degraded():
        return condition(await kube.get(*IDEP, ns, "bad"), "Degraded").get("reason") == "InvalidSpec"

    await eventually(degraded, 30, "Degraded InvalidSpec")
    idep = await kube.get(*IDEP, ns, "bad")
    assert condition(idep, "Degraded")["message"].startswith("spec.kvTransfer.backend: ")
    assert (condition(idep, "Progressing")["status"], condition(idep, "Progressing")["reason"]) == (
        "False",
        "InvalidSpec",
    )
    assert await sts(kube, ns, "bad-prefill") is None and await sts(kube, ns, "bad-decode") is None


async def test_kv_tiers_reach_the_statefulset_and_a_disk_without_host_is_refused(kube, ns):
    body = example("tiers", ns)
    body["spec"]["decode"]["kvCache"]["disk"] = {"size": "2Gi"}
    with pytest.raises(KubeError) as err:  # the API server's CEL rule
        await create(kube, body)
    assert err.value.status == 422 and "kvCache.disk needs kvCache.host" in str(err.value)

    body = example("tiers", ns)
    body["spec"]["decode"]["kvCache"].update(
        host={"memory": "256Mi"}, disk={"size": "2Gi", "storageClassName": "local-nvme"}
    )
    await create(kube, body)

    async def built():
        return await sts(kube, ns, "tiers-decode") is not None

    await eventually(built, 30, "the decode StatefulSet")
    decode = await sts(kube, ns, "tiers-decode")
    (claim,) = decode["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "local-nvme"
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert decode["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Delete",
        "whenScaled": "Delete",
    }
    args = decode["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--kv-host-cache-memory") + 1] == str(256 << 20)
    # the pod as the StatefulSet controller makes it (its claim's volume added), admitted by the API
    # server and the namespace's `restricted` Pod Security
    template = copy.deepcopy(decode["spec"]["template"])
    template["spec"]["volumes"].append(
        {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": "kv-disk-tiers-decode-0"}}
    )
    await _dry_run_pod(kube, ns, "tiers-pod", template)


async def test_per_pod_certificates_need_a_server_name_and_their_pods_are_restricted(kube, ns):
    body = example("certs", ns)
    body["spec"]["grpcTLS"] = {"perPodIssuer": {"name": "mesh-ca"}}
    with pytest.raises(KubeError) as err:  # the API server's CEL rule
        await create(kube, body)
    assert err.value.status == 422 and "perPodIssuer needs serverName" in str(err.value)

    body["spec"]["grpcTLS"]["serverName"] = "certs.disagg"
    await create(kube, body)
    decode = await eventually(lambda: sts(kube, ns, "certs-decode"), 30, "the decode StatefulSet")
    template = decode["spec"]["template"]
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "grpc-tls"]
    assert volume["csi"]["volumeAttributes"]["csi.cert-manager.io/issuer-kind"] == "Issuer"  # CRD default
    assert {"name": "DISAGG_PEER_IDENTITY", "value": "certificate"} in template["spec"]["containers"][0][
        "env"
    ]
    # a csi volume is among the volume types `restricted` allows
    await _dry_run_pod(kube, ns, "certs-pod", template)


LWS = ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
LWS_CRD = yaml.safe_load((pathlib.Path(__file__).parent / "leaderworkerset-crd.yaml").read_text())


def _spanning(name: str, ns: str, tp: int) -> dict:
    """The CPU example with decode on GPUs: 16 ranks span two nodes of the chart's 8 GPUs."""
    body = example(name, ns)
    body["spec"]["decode"]["tensorParallelSize"] = tp
    body["spec"]["decode"]["resources"] = {"limits": {"memory": "2Gi", "nvidia.com/gpu": min(tp, 8)}}
    return body


async def _dry_run_pod(kube, ns: str, name: str, template: dict) -> None:
    """The API server's own pod validation and the namespace's `restricted` Pod Security admission,
    without creating anything (no LeaderWorkerSet controller runs here to make the pods)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **template["metadata"]},
           "spec": template["spec"]}  # fmt: skip
    await kube.request("POST", f"/api/v1/namespaces/{ns}/pods", body=pod, params={"dryRun": "All"})


async def test_a_role_spanning_nodes_is_refused_without_the_lws_api_and_built_as_an_lws_with_it(kube, ns):
    served_before = await kube.serves(LWS[0], "leaderworkersets")
    body = _spanning("wide", ns, 16)
    await create(kube, body)
    if not served_before:  # the suite's own control plane: no LeaderWorkerSet installed

        async def refused():
            return condition(await kube.get(*IDEP, ns, "wide"), "Degraded").get("reason") == "InvalidSpec"

        await eventually(refused, 30, "Degraded InvalidSpec")
        message = condition(await kube.get(*IDEP, ns, "wide"), "Degraded")["message"]
        assert message.startswith("spec.decode.tensorParallelSize: is 16"), message
        assert "does not serve leaderworkerset.x-k8s.io/v1" in message
        assert await sts(kube, ns, "wide-decode") is None
        await kube.apply(LWS_CRD, field_manager=USER)
        await eventually(lambda: kube.serves(LWS[0], "leaderworkersets"), 30, "the LWS CRD served")
    try:
        body["spec"]["decode"]["replicas"] = 2  # an edit: the next reconcile finds the API
        await create(kube, body)
        lws = await eventually(lambda: kube.get(*LWS, ns, "wide-decode-lws"), 60, "the LeaderWorkerSet")
        assert lws["spec"]["replicas"] == 2
        group = lws["spec"]["leaderWorkerTemplate"]
        assert (group["size"], group["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
        owner = lws["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("InferenceDeployment", "wide", True)
        assert await sts(kube, ns, "wide-decode") is None and await sts(kube, ns, "wide-prefill") is not None
        for part in ("leaderTemplate", "workerTemplate"):
            await _dry_run_pod(kube, ns, f"wide-{part.lower()}", group[part])

        async def accepted():  # the status is written after the children: it may trail the LWS
            idep = await kube.get(*IDEP, ns, "wide")
            return condition(idep, "Degraded").get("reason") != "InvalidSpec" and idep

        idep = await eventually(accepted, 30, "the spec accepted once the LWS API is served")
        assert idep["status"]["decode"]["replicas"] == 2  # the LWS's groups (no controller: none ready)

        await create(kube, _spanning("wide", ns, 8))  # fits a node again: back to a StatefulSet

        async def swapped():
            return await kube.get(*LWS, ns, "wide-decode-lws") is None and await sts(kube, ns, "wide-decode")

        await eventually(swapped, 60, "the LWS pruned, the StatefulSet back")
    finally:
        await kube.delete(*IDEP, ns, "wide")
        if not served_before:

            async def lws_gone():
                return not await kube.list(*LWS, ns, "")

            await eventually(lws_gone, 60, "no LeaderWorkerSet left")
            await kube.delete(
                "apiextensions.k8s.io/v1", "CustomResourceDefinition", None, LWS_CRD["metadata"]["name"]
            )


async def test_deletion_runs_the_finalizer_and_children_are_collected(kube, ns):
    body = example("bye", ns)
    body["spec"]["redis"] = {
        "external": {"url": "redis://127.0.0.1:1/0", "passwordSecret": {"name": "bye-redis"}}
    }
    await create(kube, body)
    await ready(kube, ns, "bye")
    uid = (await kube.get(*IDEP, ns, "bye"))["metadata"]["uid"]
    await kube.delete(*IDEP, ns, "bye")
    await eventually(lambda: reasons(kube, ns, "bye", "CleanupScheduled"), 30, "the finalizer's Event")
    # The key cleanup runs as a Job (admitted under `restricted`) with the password by reference.
    job = await kube.get("batch/v1", "Job", ns, f"bye-cleanup-{uid[:8]}")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["disagg", "cleanup"]
    assert "ownerReferences" not in job["metadata"]

    async def collected():
        left = [await kube.get(*IDEP, ns, "bye")]
        left += [await sts(kube, ns, f"bye-{r}") for r in ("prefill", "decode")]
        left += [
            await kube.get("apps/v1", "Deployment", ns, "bye-router"),
            await kube.get("v1", "Service", ns, "bye"),
        ]
        return all(x is None for x in left)

    await eventually(collected, 60, "the resource and its children gone")
