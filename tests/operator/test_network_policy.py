"""The NetworkPolicies allow exactly the deployment's paths: checked by evaluating their selectors
against the pod templates the builders emit (who may talk to whom on which port)."""

from __future__ import annotations

import kubernetes_validate
import pytest
from kube_emulator import load_example

from disagg.operator import spec as specs
from disagg.operator.builders import build_children
from disagg.operator.settings import Settings

SETTINGS = Settings(operator_namespace="ops")


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def _world(body: dict):
    kids = build_children(specs.parse(body), body, settings=SETTINGS)
    pods = {
        m["metadata"]["name"].removeprefix("tiny-"): m["spec"]["template"]["metadata"]["labels"]
        for m in kids
        if m["kind"] in ("StatefulSet", "Deployment")
    }
    policies = {m["metadata"]["name"]: m for m in kids if m["kind"] == "NetworkPolicy"}
    return pods, policies


def allowed(pods, policies, src: str, dst: str, port: int) -> bool:
    """Whether `src` pod may open TCP `port` on `dst` pod (both directions' policies agree)."""

    def rule_ok(rules, peer_labels, peer_ns_name="default"):
        for rule in rules:
            ports = rule.get("ports")
            if ports and not any(p.get("port") in (None, port) and p["protocol"] == "TCP" for p in ports):
                continue
            peers = rule.get("from", rule.get("to"))
            if peers is None:
                return True
            for peer in peers:
                if (
                    "podSelector" in peer
                    and "namespaceSelector" not in peer
                    and _selects(peer["podSelector"], peer_labels)
                ):
                    return True
        return False

    egress = [p for p in policies.values() if _selects(p["spec"]["podSelector"], pods[src])]
    ingress = [p for p in policies.values() if _selects(p["spec"]["podSelector"], pods[dst])]
    out_ok = not egress or any(rule_ok(p["spec"]["egress"], pods[dst]) for p in egress)
    in_ok = not ingress or any(rule_ok(p["spec"]["ingress"], pods[src]) for p in ingress)
    return out_ok and in_ok


def test_only_the_deployments_paths_are_open():
    pods, policies = _world(load_example("cpu-tiny.yaml"))
    assert set(policies) == {"tiny-router", "tiny-workers", "tiny-redis"}
    for policy in policies.values():
        kubernetes_validate.validate(policy, "1.35", strict=True)
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    open_paths = {
        ("router", "decode", 50051), ("router", "prefill", 50051),
        ("prefill", "decode", 50051), ("decode", "prefill", 50051),
        ("prefill", "decode", 40123), ("decode", "prefill", 40123),  # UCX's ephemeral TCP ports
        ("router", "redis", 6379), ("prefill", "redis", 6379), ("decode", "redis", 6379),
    }  # fmt: skip
    for src in pods:
        for dst in pods:
            for port in (50051, 40123, 6379, 9100, 8000):
                if src != dst:
                    # workers reach each other on every TCP port (UCX's listeners are ephemeral)
                    between_workers = {src, dst} == {"prefill", "decode"}
                    expected = between_workers or (src, dst, port) in open_paths
                    assert allowed(pods, policies, src, dst, port) == expected, (src, dst, port)


def test_clients_metrics_and_dns():
    body = load_example("cpu-tiny.yaml")
    _, policies = _world(body)
    router = policies["tiny-router"]["spec"]
    assert router["ingress"][0] == {
        "ports": [{"protocol": "TCP", "port": 8000}],
        "from": [{"podSelector": {}}],
    }
    ops = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}}
    assert {"from": [ops], "ports": [{"protocol": "TCP", "port": 8000}]} in router["ingress"]
    workers = policies["tiny-workers"]["spec"]
    assert {"from": [ops], "ports": [{"protocol": "TCP", "port": 9100}]} in workers["ingress"]
    dns = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    assert dns in router["egress"] and dns in workers["egress"]
    assert policies["tiny-redis"]["spec"]["egress"] == []
    # A LoadBalancer's clients arrive from nodes: any source; or the sources the spec names.
    body["spec"]["router"]["service"] = {"type": "LoadBalancer"}
    assert "from" not in _world(body)[1]["tiny-router"]["spec"]["ingress"][0]
    peer = {"namespaceSelector": {"matchLabels": {"team": "web"}}}
    body["spec"]["networkPolicy"] = {"clientsFrom": [peer], "metricsNamespaces": ["monitoring"]}
    router = _world(body)[1]["tiny-router"]["spec"]
    assert router["ingress"][0]["from"] == [peer]
    assert len(router["ingress"][1]["from"]) == 2


@pytest.mark.parametrize("redis_url", ["redis://cache.infra:6380/0"])
def test_external_redis_port_and_turning_them_off(redis_url):
    body = load_example("cpu-tiny.yaml")
    body["spec"]["redis"] = {"external": {"url": redis_url}}
    _, policies = _world(body)
    assert "tiny-redis" not in policies
    assert {"ports": [{"protocol": "TCP", "port": 6380}]} in policies["tiny-workers"]["spec"]["egress"]
    body["spec"]["networkPolicy"] = {"enabled": False}
    assert _world(body)[1] == {}
