"""Every pod the operator builds and the chart renders passes the `restricted` Pod Security Standard
(checked by `pod_security`, written from the standard's definition)."""

from __future__ import annotations

import copy

import pytest
from kube_emulator import ROOT, load_example
from pod_security import pod_specs, violations
from test_operator_chart import render

from disagg.operator import spec as specs
from disagg.operator.builders import build_children, cleanup_job
from disagg.operator.settings import Settings

EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))


def _hf(spec):
    spec["model"]["source"] = {"huggingFace": {"repo": "org/model", "tokenSecret": {"name": "hf"}}}


def _tls_and_keys(spec):
    spec["grpcTLS"] = {"secretName": "grpc-tls", "serverName": "disagg.internal"}
    spec["router"]["apiKeySecret"] = {"name": "keys"}


def _per_pod_certificates(spec):
    spec["grpcTLS"] = {"perPodIssuer": {"name": "ca-issuer"}, "serverName": "disagg.internal"}


def _pvc(spec):
    spec["model"]["source"] = {"pvc": {"claimName": "models"}}


def _external_redis(spec):
    spec["redis"] = {"external": {"url": "redis://r:6379/0", "passwordSecret": {"name": "auth"}}}


VARIANTS = {
    "hugging-face": _hf,
    "tls-and-api-keys": _tls_and_keys,
    "per-pod-certificates": _per_pod_certificates,
    "pvc": _pvc,
    "external-redis": _external_redis,
}


def _pods(example: str, variant=None, settings=Settings()) -> dict[str, dict]:
    body = load_example(example)
    if variant:
        variant(body["spec"])
    idep = specs.parse(body)
    manifests = build_children(idep, body, service_monitor_available=True, settings=settings)
    if not idep.spec.redis.managed:
        manifests.append(cleanup_job.job(idep))
    return pod_specs(manifests)


@pytest.mark.parametrize(
    ("example", "variant"),
    [(e, None) for e in EXAMPLES] + [("cpu-tiny.yaml", v) for v in VARIANTS],
)
def test_every_pod_the_operator_builds_is_restricted(example, variant):
    pods = _pods(example, VARIANTS.get(variant))
    if example == "gpu-llama3-8b.yaml":
        pytest.skip("RDMA workers need IPC_LOCK, beyond `restricted` (checked below)")
    assert pods
    for name, pod in pods.items():
        assert violations(pod) == [], name


def test_what_restricted_refuses_is_caught():
    """The checker fails what it should: a host path (allowed by the installer) and RDMA's IPC_LOCK."""
    body_pods = _pods("cpu-tiny.yaml", lambda s: s["model"].update(source={"hostPath": {"path": "/data/m"}}),
                      Settings(host_path_prefixes=("/data",)))  # fmt: skip
    assert "spec.volumes[model].hostPath" in violations(body_pods["StatefulSet/tiny-decode"])
    rdma = _pods("gpu-llama3-8b.yaml")["StatefulSet/llama3-8b-decode"]
    assert "containers[worker].securityContext.capabilities.add" in violations(rdma)
    broken = copy.deepcopy(_pods("cpu-tiny.yaml")["StatefulSet/tiny-decode"])
    del broken["securityContext"]["seccompProfile"]
    broken["containers"][0]["securityContext"]["readOnlyRootFilesystem"] = False
    assert violations(broken) == [
        "containers[worker].securityContext.readOnlyRootFilesystem",
        "containers[worker].securityContext.seccompProfile",
        "initContainers[make-model].securityContext.seccompProfile",
    ]


@pytest.mark.parametrize("values", [{}, {"clusterWide": True}])
def test_the_charts_operator_pod_is_restricted(values):
    pods = pod_specs(render(values))
    assert list(pods) == ["Deployment/disagg"]
    assert violations(pods["Deployment/disagg"]) == []
