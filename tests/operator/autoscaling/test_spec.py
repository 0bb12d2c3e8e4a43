"""The autoscaling section: defaults, and errors that name the field."""

from __future__ import annotations

import pytest

from disagg.operator.autoscaling.spec import AutoscalingSpecError, autoscaled_roles, parse_autoscaling


def test_defaults_match_the_crd():
    s = parse_autoscaling("prefill", {"maxReplicas": 4, "target": {"ttftMilliseconds": 800}})
    assert (s.min_replicas, s.max_replicas, s.target_seconds, s.percentile) == (1, 4, 0.8, 90.0)
    assert (s.scale_up.stabilization_seconds, s.scale_up.max_step) == (0, None)
    assert (s.scale_down.stabilization_seconds, s.scale_down.max_step) == (300, 1)
    assert (s.mode, s.metrics_url) == ("operator", None)
    assert s.clamp(9) == 4 and s.clamp(0) == 1


@pytest.mark.parametrize(
    "role, raw, field",
    [
        ("prefill", {"target": {"ttftMilliseconds": 500}}, "spec.prefill.autoscaling.maxReplicas"),
        (
            "prefill",
            {"maxReplicas": 2, "minReplicas": 3, "target": {"ttftMilliseconds": 5}},
            "spec.prefill.autoscaling.minReplicas",
        ),
        (
            "prefill",
            {"maxReplicas": 2, "target": {"itlMilliseconds": 5}},
            "spec.prefill.autoscaling.target",
        ),
        ("decode", {"maxReplicas": 2, "target": {}}, "spec.decode.autoscaling.target"),
        (
            "decode",
            {"maxReplicas": 2, "target": {"itlMilliseconds": 0}},
            "spec.decode.autoscaling.target.itlMilliseconds",
        ),
        (
            "decode",
            {"maxReplicas": 2, "target": {"itlMilliseconds": 30, "percentile": 100}},
            "spec.decode.autoscaling.target.percentile",
        ),
        (
            "decode",
            {"maxReplicas": "3", "target": {"itlMilliseconds": 30}},
            "spec.decode.autoscaling.maxReplicas",
        ),
        (
            "decode",
            {"maxReplicas": 3, "target": {"itlMilliseconds": 30}, "scaleDown": {"maxStep": 0}},
            "spec.decode.autoscaling.scaleDown.maxStep",
        ),
        (
            "decode",
            {"maxReplicas": 3, "target": {"itlMilliseconds": 30}, "scaleUp": {"stabilizationSeconds": -1}},
            "spec.decode.autoscaling.scaleUp.stabilizationSeconds",
        ),
        (
            "decode",
            {"maxReplicas": 3, "target": {"itlMilliseconds": 30}, "mode": "keda"},
            "spec.decode.autoscaling.mode",
        ),
        (
            "decode",
            {"maxReplicas": 3, "target": {"itlMilliseconds": 30}, "metricsUrl": "prometheus:9090"},
            "spec.decode.autoscaling.metricsUrl",
        ),
    ],
)
def test_bad_sections_name_the_field(role, raw, field):
    with pytest.raises(AutoscalingSpecError) as err:
        parse_autoscaling(role, raw)
    assert str(err.value).startswith(field + ":")


def test_autoscaled_roles_picks_only_autoscaled_roles():
    spec = {
        "prefill": {"autoscaling": {"maxReplicas": 3, "target": {"ttftMilliseconds": 400}}},
        "decode": {"replicas": 2},
    }
    assert list(autoscaled_roles(spec)) == ["prefill"]
