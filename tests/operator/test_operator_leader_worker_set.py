"""A GPU role with more ranks than a node gives a pod runs as a LeaderWorkerSet: the leader is the
worker with its node's ranks, the other pods run `disagg tp-ranks` pointed at it through the LWS
variables; the same hardening, credentials and network paths as StatefulSet pods; replicas and HPA
scale the LWS; without the LWS API the status names spec.<role>.tensorParallelSize."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from kube_emulator import load_example
from pod_security import pod_specs, violations
from test_network_policy import allowed

from disagg.operator import rollout
from disagg.operator import spec as specs
from disagg.operator.builders import build_children, leader_worker_set
from disagg.operator.settings import Settings
from disagg.worker import cli

KUBE_VERSION = "1.35"
SETTINGS = Settings(gpus_per_node=8, operator_namespace="ops")
TOKEN_REF = {"secretKeyRef": {"name": "llama3-8b-credentials", "key": "internal-token"}}


def _body(tp: int = 16, gpus: int = 8, **decode) -> dict:
    body = load_example("gpu-llama3-8b.yaml")
    role = body["spec"]["decode"]
    del role["autoscaling"]
    role.update(replicas=2, tensorParallelSize=tp, **decode)
    role["resources"] = {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": gpus},
                         "limits": {"memory": "96Gi", "nvidia.com/gpu": gpus}}  # fmt: skip
    return body


def _build(body: dict, settings: Settings = SETTINGS, lws: bool = True) -> dict[tuple[str, str], dict]:
    children = build_children(specs.parse(body), body, settings=settings, leader_worker_sets=lws)
    return {(m["kind"], m["metadata"]["name"]): m for m in children}


def _args(container: dict):
    env = {"$(POD_NAME)": "pod-0", "$(POD_IP)": "10.0.0.1", "$(LWS_LEADER_ADDRESS)": "leader.svc",
           "$(LWS_WORKER_INDEX)": "1"}  # fmt: skip
    argv = []
    for arg in container["args"]:
        for var, value in env.items():
            arg = arg.replace(var, value)
        argv.append(arg)
    _module, args = cli.parse(argv)
    return args


def _templates(lws: dict) -> tuple[dict, dict]:
    t = lws["spec"]["leaderWorkerTemplate"]
    return t["leaderTemplate"], t["workerTemplate"]


def test_a_role_spanning_nodes_is_one_leader_worker_set_and_no_statefulset():
    kids = _build(_body(tp=16))
    assert ("StatefulSet", "llama3-8b-decode") not in kids
    assert ("StatefulSet", "llama3-8b-prefill") in kids  # the other role is unchanged
    lws = kids[("LeaderWorkerSet", "llama3-8b-decode-lws")]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["ownerReferences"][0]["kind"] == "InferenceDeployment"
    assert lws["spec"]["replicas"] == 2
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = _templates(lws)
    for template in (leader, worker):
        # each template is a valid pod template (checked as a StatefulSet's)
        sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "t"},
               "spec": {"serviceName": "t", "selector": {"matchLabels": template["metadata"]["labels"]},
                        "template": template}}  # fmt: skip
        kubernetes_validate.validate(rollout.stamp(sts), KUBE_VERSION, strict=True)
        (container,) = template["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8  # the ranks of one node
        (shm,) = [v for v in template["spec"]["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["sizeLimit"] == "8Gi"

    args = _args(leader["spec"]["containers"][0])
    assert (args.tensor_parallel_size, args.tensor_parallel_local_ranks) == (16, 8)
    assert args.tensor_parallel_port == leader_worker_set.TP_PORT and args.role == "decode"
    follower = worker["spec"]["containers"][0]
    args = _args(follower)
    assert args.leader == f"leader.svc:{leader_worker_set.TP_PORT}"
    assert (args.node_index, args.count, args.host) == (1, 8, "10.0.0.1")  # ranks 8..15


def test_ranks_split_evenly_over_the_fewest_nodes():
    six = Settings(gpus_per_node=6)
    kids = _build(_body(tp=8, gpus=4), six)  # 2 nodes of 4 ranks
    lws = kids[("LeaderWorkerSet", "llama3-8b-decode-lws")]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert _args(_templates(lws)[1]["spec"]["containers"][0]).count == 4
    with pytest.raises(specs.SpecError, match="split evenly") as err:
        _build(_body(tp=16, gpus=6), six)  # 3 nodes: 16 ranks do not split in 3
    assert err.value.path == "spec.decode.tensorParallelSize"
    with pytest.raises(specs.SpecError, match="must equal the 8 ranks per pod") as err:
        _build(_body(tp=16, gpus=16))
    assert err.value.path == "spec.decode.resources.limits.nvidia.com/gpu"


def test_without_the_leader_worker_set_api_the_field_is_named():
    with pytest.raises(specs.SpecError, match="does not serve leaderworkerset.x-k8s.io/v1") as err:
        _build(_body(tp=16), lws=False)
    assert err.value.path == "spec.decode.tensorParallelSize"
    _build(_body(tp=8), lws=False)  # fits a node: a StatefulSet, no LWS needed


def test_pods_are_restricted_and_carry_the_credential_by_reference():
    body = _body(tp=16)
    rdma_kids = _build(body)
    del body["spec"]["kvTransfer"]["rdma"]  # RDMA needs IPC_LOCK, beyond `restricted` (below)
    kids = _build(body)
    pods = pod_specs(list(kids.values()))
    lws_pods = {k: v for k, v in pods.items() if k.startswith("LeaderWorkerSet/")}
    assert len(lws_pods) == 2
    for name, pod in lws_pods.items():
        assert violations(pod) == [], name
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["DISAGG_INTERNAL_TOKEN"]["valueFrom"] == TOKEN_REF, name
        assert not any("value" in e and "token" in e["name"].lower() for e in container["env"])
    worker = lws_pods["LeaderWorkerSet/llama3-8b-decode-lws/workerTemplate"]
    assert "DISAGG_REDIS_PASSWORD" not in {e["name"] for e in worker["containers"][0]["env"]}
    # with RDMA every rank's pod pins memory: IPC_LOCK and the RDMA device, leader and followers alike
    for template in _templates(rdma_kids[("LeaderWorkerSet", "llama3-8b-decode-lws")]):
        (container,) = template["spec"]["containers"]
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert container["resources"]["limits"]["rdma/hca"] == 1


def test_network_policies_let_the_group_talk_and_keep_others_out():
    body = _body(tp=16)
    body["spec"]["networkPolicy"] = {"enabled": True}
    kids = _build(body)
    lws = kids[("LeaderWorkerSet", "llama3-8b-decode-lws")]
    leader, worker = _templates(lws)
    pods = {
        "leader": leader["metadata"]["labels"],
        "ranks": worker["metadata"]["labels"],
        "router": kids[("Deployment", "llama3-8b-router")]["spec"]["template"]["metadata"]["labels"],
        "prefill": kids[("StatefulSet", "llama3-8b-prefill")]["spec"]["template"]["metadata"]["labels"],
    }
    policies = {m["metadata"]["name"]: m for m in kids.values() if m["kind"] == "NetworkPolicy"}
    port = leader_worker_set.TP_PORT
    for src, dst, p in (("ranks", "leader", port), ("ranks", "leader", port + 1), ("leader", "ranks", 41234),
                        ("ranks", "leader", 41234), ("router", "leader", 50051), ("prefill", "ranks", 41234)):  # fmt: skip
        assert allowed(pods, policies, src, dst, p), (src, dst, p)
    assert not allowed(pods, policies, "router", "ranks", port)
    # the role's Service selects the leader (and its group's pods), as it selects StatefulSet pods
    service = kids[("Service", "llama3-8b-decode")]["spec"]["selector"]
    assert all(leader["metadata"]["labels"][k] == v for k, v in service.items())


def test_hpa_scales_the_leader_worker_set_and_the_operators_autoscaler_is_refused():
    body = _body(tp=16)
    del body["spec"]["decode"]["replicas"]
    body["spec"]["decode"]["autoscaling"] = {
        "maxReplicas": 4,
        "target": {"itlMilliseconds": 40},
        "mode": "hpa",
    }
    kids = _build(body)
    hpa = kids[("HorizontalPodAutoscaler", "llama3-8b-decode")]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "llama3-8b-decode-lws",
    }
    assert kids[("LeaderWorkerSet", "llama3-8b-decode-lws")]["spec"]["replicas"] == 1  # created at min
    operator_mode = copy.deepcopy(body)
    operator_mode["spec"]["decode"]["autoscaling"]["mode"] = "operator"
    with pytest.raises(specs.SpecError, match="autoscale it with mode hpa") as err:
        _build(operator_mode)
    assert err.value.path == "spec.decode.autoscaling.mode"
