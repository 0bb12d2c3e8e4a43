"""NetworkPolicies that allow only the deployment's own paths (docs/security.md lists them).

- clients -> router: the API port, from `networkPolicy.clientsFrom` (default: this namespace's
  pods for a ClusterIP Service, anyone for NodePort/LoadBalancer, whose traffic arrives from nodes);
- router -> workers: gRPC;
- workers <-> workers: every TCP port. NIXL moves KV blocks over UCX, whose TCP transport listens
  on ephemeral ports chosen at start (UCX_TCP_PORT_RANGE defaults to any), so no fixed port list
  exists; the peers are still only this deployment's workers;
- router and workers -> Redis (the managed pod's port, or an external Redis' URL port);
- metrics (router's API port serves /metrics, workers' metrics port) from the operator's
  namespace (its autoscaler scrapes them) and `networkPolicy.metricsNamespaces`;
- DNS to any resolver (port 53), and for a Hugging Face model source HTTPS out (the download).

Each selected pod is default-deny in both directions for everything else.
"""

from __future__ import annotations

import urllib.parse

from disagg.operator import constants as c
from disagg.operator.builders import common
from disagg.operator.settings import Settings
from disagg.operator.spec import InferenceDeployment

DNS_PORTS = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
HTTPS_PORT = 443
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace


def policy_name(idep: InferenceDeployment, part: str) -> str:
    return f"{idep.name}-{part}"


def _pods(idep: InferenceDeployment, *components: str) -> dict:
    """A selector of this deployment's pods of the given components."""
    return {
        "matchLabels": {c.LABEL_DEPLOYMENT: idep.name, c.LABEL_MANAGED_BY: c.FIELD_MANAGER},
        "matchExpressions": [{"key": c.LABEL_COMPONENT, "operator": "In", "values": list(components)}],
    }


def _peer(idep: InferenceDeployment, *components: str) -> dict:
    return {"podSelector": _pods(idep, *components)}


def _tcp(port) -> dict:
    return {"protocol": "TCP", "port": port}


def _redis_port(idep: InferenceDeployment) -> int:
    if idep.spec.redis.managed:
        return c.REDIS_PORT
    return urllib.parse.urlsplit(idep.spec.redis.url).port or c.REDIS_PORT


def _redis_egress(idep: InferenceDeployment) -> dict:
    rule = {"ports": [_tcp(_redis_port(idep))]}
    if idep.spec.redis.managed:
        rule["to"] = [_peer(idep, "redis")]
    # An external Redis: its address is not known as pods or CIDRs here, only its port.
    return rule


def _common_egress(idep: InferenceDeployment) -> list[dict]:
    out = [{"ports": DNS_PORTS}, _redis_egress(idep)]
    if idep.spec.model.source.kind == "huggingFace":
        out.append({"ports": [_tcp(HTTPS_PORT)]})  # the model download init container
    return out


def _metrics_sources(idep: InferenceDeployment, settings: Settings) -> list[dict]:
    namespaces = list(idep.spec.network_policy.metrics_namespaces)
    if settings.operator_namespace and settings.operator_namespace not in namespaces:
        namespaces.insert(0, settings.operator_namespace)
    return [{"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: ns}}} for ns in namespaces]


def _clients(idep: InferenceDeployment) -> list[dict] | None:
    """The router's API sources; None means any source (the rule has no `from`)."""
    configured = idep.spec.network_policy.clients_from
    if configured is not None:
        return [dict(peer) for peer in configured]
    if idep.spec.router.service_type == "ClusterIP":
        return [{"podSelector": {}}]
    return None


def _policy(idep: InferenceDeployment, part: str, selector: dict, ingress: list, egress: list) -> dict:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": common.metadata(idep, policy_name(idep, part), "network-policy"),
        "spec": {
            "podSelector": selector,
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }


def router_policy(idep: InferenceDeployment, settings: Settings) -> dict:
    api = {"ports": [_tcp(idep.spec.router.port)]}
    clients = _clients(idep)
    if clients is not None:
        api["from"] = clients
    ingress = [api]
    metrics = _metrics_sources(idep, settings)
    if metrics and clients is not None:
        ingress.append({"from": metrics, "ports": [_tcp(idep.spec.router.port)]})
    egress = [{"to": [_peer(idep, *c.ROLES)], "ports": [_tcp(c.WORKER_GRPC_PORT)]}, *_common_egress(idep)]
    return _policy(idep, "router", _pods(idep, "router"), ingress, egress)


def workers_policy(idep: InferenceDeployment, settings: Settings) -> dict:
    workers = _peer(idep, *c.ROLES)
    ingress = [
        {"from": [_peer(idep, "router")], "ports": [_tcp(c.WORKER_GRPC_PORT)]},
        # gRPC and NIXL/UCX between workers: UCX's TCP listeners use ephemeral ports (see above).
        {"from": [workers], "ports": [{"protocol": "TCP"}]},
    ]
    metrics = _metrics_sources(idep, settings)
    if metrics:
        ingress.append({"from": metrics, "ports": [_tcp(c.WORKER_METRICS_PORT)]})
    egress = [{"to": [workers], "ports": [{"protocol": "TCP"}]}, *_common_egress(idep)]
    return _policy(idep, "workers", _pods(idep, *c.ROLES), ingress, egress)


def redis_policy(idep: InferenceDeployment) -> dict:
    ingress = [{"from": [_peer(idep, "router", *c.ROLES)], "ports": [_tcp(c.REDIS_PORT)]}]
    return _policy(idep, "redis", _pods(idep, "redis"), ingress, [])


def policies(idep: InferenceDeployment, settings: Settings) -> list[dict]:
    if not idep.spec.network_policy.enabled:
        return []
    out = [router_policy(idep, settings), workers_policy(idep, settings)]
    if idep.spec.redis.managed:
        out.append(redis_policy(idep))
    return out
