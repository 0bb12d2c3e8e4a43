"""The CRD: a valid, structural, fully described schema that accepts the examples and rejects bad
resources naming the field; its CEL rules agree with the operator's mirror and its defaults with the
operator's parser."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kube_emulator import ROOT, load_example
from structural_schema import problems

from disagg.operator import rules
from disagg.operator import spec as specs

CRD_PATH = ROOT / "crds" / "inferencedeployment.yaml"
CRD = yaml.safe_load(CRD_PATH.read_text())
SCHEMA = next(v for v in CRD["spec"]["versions"] if v["name"] == "v1alpha1")["schema"]["openAPIV3Schema"]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))


def walk(node: dict, path: str = ""):
    """Every schema node with its path (properties, items, additionalProperties)."""
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{name}" if path else name)
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def schema_errors(resource: dict) -> list[str]:
    validator = jsonschema.Draft4Validator(SCHEMA)
    return [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(resource)
    ]


def test_crd_is_a_valid_kubernetes_object_and_the_chart_ships_the_same_file():
    kubernetes_validate.validate(CRD, "1.35", strict=True)
    assert (
        ROOT / "charts" / "disagg" / "crds" / "inferencedeployment.yaml"
    ).read_bytes() == CRD_PATH.read_bytes()
    names = CRD["spec"]["names"]
    assert (CRD["spec"]["group"], names["kind"], names["plural"], names["shortNames"]) == (
        "disagg.dev",
        "InferenceDeployment",
        "inferencedeployments",
        ["idep"],
    )
    version = CRD["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Prefill",
        "Decode",
        "Ready",
        "Endpoint",
        "Age",
    ]


def test_schema_is_structural_and_every_field_is_described():
    assert problems(SCHEMA) == []
    for path, node in walk(SCHEMA):
        if path.endswith("{}") or path == "metadata":
            continue  # map values are not fields; the API server allows nothing but `type` on metadata
        assert node.get("description"), f"{path or '<root>'} has no description"
        typed = (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        )
        assert typed, f"{path} has no type"


def _mutated(change) -> dict:
    schema = copy.deepcopy(SCHEMA)
    change(schema)
    return schema


# Schemas a real API server refuses (each seen from kube-apiserver 1.36), and the rule each breaks.
REFUSED = [
    (lambda s: s["properties"]["metadata"].update(description="Standard object metadata."), "metadata"),
    (lambda s: s["properties"]["metadata"].update(properties={"labels": {"type": "object"}}), "metadata"),
    (lambda s: s["properties"]["spec"]["properties"]["model"].pop("type"), "type: must not be empty"),
    (
        lambda s: s["properties"]["spec"]["properties"]["router"].update(
            additionalProperties={"type": "string"}
        ),
        "additionalProperties: must not be used if properties is set",
    ),
    (
        lambda s: s["properties"]["spec"]["properties"]["kvTransfer"]["properties"]["ucxTransports"].update(
            uniqueItems=True
        ),
        "uniqueItems",
    ),
    (
        lambda s: s["properties"]["status"]["properties"]["conditions"]["items"]["required"].remove("type"),
        "map keys must be required or defaulted",
    ),
    (
        lambda s: s["properties"]["spec"]["properties"]["router"]["properties"]["resources"]["properties"][
            "limits"
        ]["additionalProperties"]["anyOf"][0].update(description="x"),
        "logical junctor",
    ),
    (lambda s: s["properties"]["spec"].update({"$ref": "#/definitions/x"}), "$ref: is forbidden"),
]


@pytest.mark.parametrize(("change", "rule"), REFUSED)
def test_the_structural_check_refuses_what_the_api_server_refuses(change, rule):
    found = problems(_mutated(change))
    assert any(rule in p for p in found), found


@pytest.mark.parametrize("example", EXAMPLES)
def test_examples_pass_the_schema_and_the_rules(example):
    body = load_example(example)
    assert schema_errors(body) == []
    assert rules.violations(body) == []
    specs.parse(body)


# (mutation of the CPU example's spec, the field the rejection must name)
SCHEMA_BAD = [
    (lambda s: s["model"].update(dtype="fp8"), "spec.model.dtype"),
    (lambda s: s["model"].pop("name"), "spec.model"),
    (lambda s: s["model"].update(maxModelLength=0), "spec.model.maxModelLength"),
    (
        lambda s: s["model"].update(source={"hostPath": {"path": "relative/dir"}}),
        "spec.model.source.hostPath.path",
    ),
    (
        lambda s: s["model"].update(source={"huggingFace": {"repo": "no-owner"}}),
        "spec.model.source.huggingFace.repo",
    ),
    (lambda s: s["model"]["source"]["generate"].update(preset="huge"), "spec.model.source.generate.preset"),
    (lambda s: s["prefill"].update(replicas="two"), "spec.prefill.replicas"),
    (lambda s: s["prefill"].update(replicas=-1), "spec.prefill.replicas"),
    (lambda s: s["decode"].update(tensorParallelSize=3), "spec.decode.tensorParallelSize"),
    (lambda s: s["decode"].update(kvCache={"memoryFraction": 1.5}), "spec.decode.kvCache.memoryFraction"),
    (lambda s: s["decode"].update(kvCache={"blockSize": 12}), "spec.decode.kvCache.blockSize"),
    (
        lambda s: (
            s["router"]["service"].update(type="Ingress")
            if "service" in s["router"]
            else s["router"].update(service={"type": "Ingress"})
        ),
        "spec.router.service.type",
    ),
    (lambda s: s["kvTransfer"].update(backend="rdma"), "spec.kvTransfer.backend"),
    (lambda s: s.update(speculativeDecoding={"method": "medusa"}), "spec.speculativeDecoding.method"),
    (lambda s: s.update(speculativeDecoding={"numTokens": 2}), "spec.speculativeDecoding"),
    (
        lambda s: s.update(speculativeDecoding={"method": "ngram", "numTokens": 17}),
        "spec.speculativeDecoding.numTokens",
    ),
    (
        lambda s: s["kvTransfer"].update(ucxTransports=["tcp", "carrier-pigeon"]),
        "spec.kvTransfer.ucxTransports.1",
    ),
    (lambda s: s.update(redis={"external": {"url": "http://cache:6379"}}), "spec.redis.external.url"),
    (lambda s: s["router"].update(prefillOverflow=-0.5), "spec.router.prefillOverflow"),
    (
        lambda s: (
            s["decode"].pop("replicas")
            and s["decode"].update(
                autoscaling={"minReplicas": 1, "maxReplicas": 2, "target": {"itlMilliseconds": 0}}
            )
        ),
        "spec.decode.autoscaling.target.itlMilliseconds",
    ),
    (
        lambda s: (
            s["prefill"].pop("replicas")
            and s["prefill"].update(
                autoscaling={"maxReplicas": 2, "target": {"ttftMilliseconds": 200}, "mode": "keda"}
            )
        ),
        "spec.prefill.autoscaling.mode",
    ),
]


@pytest.mark.parametrize(("mutate", "field"), SCHEMA_BAD)
def test_bad_resources_are_rejected_by_the_schema_naming_the_field(mutate, field):
    body = load_example("cpu-tiny.yaml")
    mutate(body["spec"])
    errors = schema_errors(body)
    assert errors, "accepted"
    assert any(e.startswith(field + ":") for e in errors), errors


def _autoscaling(target: dict) -> dict:
    return {"minReplicas": 1, "maxReplicas": 4, "target": target}


def _swap_to_autoscaling(s: dict, role: str, auto: dict, keep_replicas: bool = False) -> None:
    if not keep_replicas:
        s[role].pop("replicas")
    s[role]["autoscaling"] = auto


# Cases only CEL can catch (the plain schema accepts them): (mutation, path named, rule message)
CEL_BAD = [
    (
        lambda s: _swap_to_autoscaling(
            s, "decode", _autoscaling({"itlMilliseconds": 40}), keep_replicas=True
        ),
        "spec.decode",
        "set exactly one of replicas and autoscaling",
    ),
    (lambda s: s["prefill"].pop("replicas"), "spec.prefill", "set exactly one of replicas and autoscaling"),
    (
        lambda s: _swap_to_autoscaling(
            s, "decode", {"minReplicas": 5, "maxReplicas": 2, "target": {"itlMilliseconds": 40}}
        ),
        "spec.decode.autoscaling.minReplicas",
        "minReplicas must not exceed maxReplicas",
    ),
    (
        lambda s: _swap_to_autoscaling(s, "prefill", _autoscaling({"itlMilliseconds": 40})),
        "spec.prefill.autoscaling.target",
        "prefill autoscales on time to first token",
    ),
    (
        lambda s: _swap_to_autoscaling(s, "decode", _autoscaling({"ttftMilliseconds": 300})),
        "spec.decode.autoscaling.target",
        "decode autoscales on inter-token latency",
    ),
    (
        lambda s: _swap_to_autoscaling(
            s, "decode", _autoscaling({"ttftMilliseconds": 300, "itlMilliseconds": 40})
        ),
        "spec.decode.autoscaling.target",
        "set exactly one of ttftMilliseconds and itlMilliseconds",
    ),
    (
        lambda s: s["model"]["source"].update(pvc={"claimName": "models"}),
        "spec.model.source",
        "set exactly one of pvc, hostPath, huggingFace, generate",
    ),
    (lambda s: s["model"].update(source={}), "spec.model.source", "set exactly one of pvc"),
    (
        lambda s: s["kvTransfer"].update(ucxTransports=["cma", "sm"]),
        "spec.kvTransfer.ucxTransports",
        "NIXL needs the tcp transport",
    ),
    (
        lambda s: s["kvTransfer"].update(ucxTransports=["cma", "tcp"]),
        "spec.kvTransfer.ucxTransports",
        "cma, sm, shm, posix, sysv and self reach only processes of one pod",
    ),
    (
        lambda s: s["decode"].setdefault("kvCache", {}).update(disk={"size": "20Gi"}),
        "spec.decode.kvCache.disk",
        "kvCache.disk needs kvCache.host",
    ),
    (
        lambda s: s.update(redis={"managed": {}, "external": {"url": "redis://cache:6379"}}),
        "spec.redis",
        "set exactly one of managed and external",
    ),
    (lambda s: s.update(grpcTLS={"serverName": "disagg"}), "spec.grpcTLS", "set exactly one of secretName"),
    (
        lambda s: s.update(grpcTLS={"secretName": "tls", "perPodIssuer": {"name": "ca"}, "serverName": "d"}),
        "spec.grpcTLS",
        "set exactly one of secretName and perPodIssuer",
    ),
    (
        lambda s: s.update(grpcTLS={"perPodIssuer": {"name": "ca"}}),
        "spec.grpcTLS.serverName",
        "perPodIssuer needs serverName",
    ),
]

CEL_GOOD = [
    lambda s: None,
    lambda s: _swap_to_autoscaling(s, "prefill", _autoscaling({"ttftMilliseconds": 300})),
    lambda s: _swap_to_autoscaling(
        s, "decode", {"minReplicas": 2, "maxReplicas": 2, "target": {"itlMilliseconds": 9}}
    ),
    lambda s: s["kvTransfer"].update(ucxTransports=[]),
    lambda s: s.update(redis={"external": {"url": "redis://cache:6379"}}),
    lambda s: s["model"].update(source={"hostPath": {"path": "/models/tiny"}}),
    lambda s: s["decode"].setdefault("kvCache", {}).update(host={"memory": "1Gi"}, disk={"size": "20Gi"}),
    lambda s: s.update(grpcTLS={"secretName": "tls"}),
    lambda s: s.update(grpcTLS={"perPodIssuer": {"name": "ca", "kind": "ClusterIssuer"}, "serverName": "d"}),
]


@pytest.mark.parametrize(("mutate", "path", "message"), CEL_BAD)
def test_cel_rules_reject_what_the_schema_cannot_and_the_operator_agrees(mutate, path, message):
    body = load_example("cpu-tiny.yaml")
    mutate(body["spec"])
    assert schema_errors(body) == []
    found = rules.violations(body)
    assert any(v.startswith(f"{path}: {message}") for v in found), found


@pytest.mark.parametrize("mutate", CEL_GOOD)
def test_cel_rules_accept_good_variants(mutate):
    body = load_example("cpu-tiny.yaml")
    mutate(body["spec"])
    assert schema_errors(body) == [] and rules.violations(body) == []


def crd_rules() -> list[tuple[str, str]]:
    """Every CEL rule in the CRD as (path pattern as in the mirror, rule text)."""
    found = []
    for path, node in walk(SCHEMA):
        for rule in node.get("x-kubernetes-validations") or []:
            # The prefill and decode schemas are one YAML anchor; the mirror writes them as "*".
            generic = path.replace("spec.prefill", "spec.*").replace("spec.decode", "spec.*")
            found.append((generic, rule["rule"]))
    return sorted(set(found))


def test_every_cel_rule_has_exactly_one_mirror():
    mirrored = sorted((r.at, r.cel) for r in rules.RULES)
    assert mirrored == crd_rules()
    described = {}
    for _path, node in walk(SCHEMA):
        for rule in node.get("x-kubernetes-validations") or []:
            described[rule["rule"]] = (rule["message"], rule.get("fieldPath", ""))
    assert {r.cel: (r.message, r.field_path) for r in rules.RULES} == described


def _node_at(resource: dict, path: str):
    node = resource
    for part in path.split("."):
        node = node[part]
    return node


@pytest.mark.parametrize("case", range(len(CEL_BAD) + len(CEL_GOOD)))
def test_the_real_cel_rules_agree_with_the_mirror(case):
    """Evaluate each CRD rule with a CEL interpreter (cel-python) on the good and bad resources."""
    import celpy

    mutate = CEL_BAD[case][0] if case < len(CEL_BAD) else CEL_GOOD[case - len(CEL_BAD)]
    body = load_example("cpu-tiny.yaml")
    mutate(body["spec"])
    env = celpy.Environment()
    for rule in rules.RULES:
        program = env.program(env.compile(rule.cel))
        for path, value in rules._resolve(body, rule.at):
            real = bool(program.evaluate({"self": celpy.json_to_cel(copy.deepcopy(value))}))
            assert real == rule.check(value), (rule.cel, path)


def apply_defaults(node: dict, value):
    """Structural defaulting as the API server does it: absent fields of present objects get defaults."""
    if isinstance(value, dict):
        for name, child in (node.get("properties") or {}).items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                apply_defaults(child, value[name])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            apply_defaults(node["items"], item)
    return value


MINIMAL = {
    "apiVersion": "disagg.dev/v1alpha1",
    "kind": "InferenceDeployment",
    "metadata": {"name": "m", "namespace": "ns", "uid": "u"},
    "spec": {
        "model": {
            "name": "m",
            "source": {"huggingFace": {"repo": "org/model", "tokenSecret": {"name": "t"}}},
        },
        "router": {"apiKeySecret": {"name": "keys"}},
        "prefill": {"autoscaling": {"maxReplicas": 3, "target": {"ttftMilliseconds": 100}}},
        "decode": {"replicas": 1},
    },
}


@pytest.mark.parametrize("variant", ["minimal", "external-redis", *EXAMPLES])
def test_operator_defaults_equal_the_crd_defaults(variant):
    if variant in EXAMPLES:
        body = load_example(variant)
    else:
        body = copy.deepcopy(MINIMAL)
        if variant == "external-redis":
            body["spec"]["redis"] = {"external": {"url": "redis://r:6379", "passwordSecret": {"name": "p"}}}
    defaulted = apply_defaults(SCHEMA, copy.deepcopy(body))
    assert defaulted != body or variant in EXAMPLES
    assert specs.parse(body) == specs.parse(defaulted)
