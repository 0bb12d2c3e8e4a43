"""HPA mode: the HorizontalPodAutoscaler validates against Kubernetes' own schema."""

from __future__ import annotations

import pathlib

import kubernetes_validate
import pytest
import yaml

from disagg.operator import spec as specs
from disagg.operator.autoscaling.hpa import adapter_metric_name, adapter_values, build_hpa
from disagg.operator.builders import common
from disagg.operator.spec import InferenceDeployment

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _idep(**sections) -> InferenceDeployment:
    body = yaml.safe_load((ROOT / "examples" / "cpu-tiny.yaml").read_text())
    body["metadata"].update(name="llama", namespace="serving", uid="1234")
    for role, section in sections.items():
        body["spec"][role].pop("replicas")
        body["spec"][role]["autoscaling"] = section
    return specs.parse(body)


IDEP = _idep(
    prefill={
        "minReplicas": 2,
        "maxReplicas": 6,
        "target": {"ttftMilliseconds": 750, "percentile": 90},
        "scaleUp": {"maxStep": 2},
        "mode": "hpa",
    },
    decode={"maxReplicas": 8, "target": {"itlMilliseconds": 40, "percentile": 99}, "mode": "hpa"},
)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_hpa_validates_strictly(role):
    hpa = build_hpa(IDEP, role)
    kubernetes_validate.validate(hpa, "1.33", strict=True)
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": f"llama-{role}",
    }
    # Names, labels and the owner reference of every other child of the resource.
    assert hpa["metadata"] == common.metadata(IDEP, f"llama-{role}", role)
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == "1234"


def test_prefill_hpa_targets_ttft_with_the_spec_behaviour():
    spec = build_hpa(IDEP, "prefill")["spec"]
    metric = spec["metrics"][0]["pods"]
    assert metric["metric"]["name"] == "disagg_time_to_first_token_p90_seconds"
    assert metric["target"] == {"type": "AverageValue", "averageValue": "750m"}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 6)
    assert spec["behavior"]["scaleUp"]["policies"] == [{"type": "Pods", "value": 2, "periodSeconds": 60}]
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300


def test_decode_hpa_targets_itl_and_the_adapter_serves_it():
    metric = build_hpa(IDEP, "decode")["spec"]["metrics"][0]["pods"]
    assert (
        metric["metric"]["name"]
        == adapter_metric_name("decode", 99)
        == "disagg_inter_token_latency_p99_seconds"
    )
    assert metric["target"]["averageValue"] == "40m"
    names = [r["name"]["as"] for r in adapter_values((90, 99))["rules"]["custom"]]
    assert "disagg_inter_token_latency_p99_seconds" in names
    assert "disagg_time_to_first_token_p90_seconds" in names


def test_missing_section_is_named():
    with pytest.raises(ValueError, match=r"spec.decode.autoscaling"):
        build_hpa(_idep(), "decode")
