"""HPA mode: an `autoscaling/v2` HorizontalPodAutoscaler per role, for clusters that already
run prometheus-adapter. The HPA then owns the StatefulSet's replicas (the operator sets them
only when it creates the StatefulSet, at minReplicas; see `disagg.operator.replicas`).

The HPA reads a Pods metric named after the latency and the percentile, served by
prometheus-adapter from the workers' histograms:

    prefill: disagg_time_to_first_token_p<P>_seconds   (P = target.percentile, e.g. p90)
    decode:  disagg_inter_token_latency_p<P>_seconds

with `averageValue` = the target. Each pod's value is that pod's percentile over the last
minute, the HPA averages them over the role's pods and scales proportionally (desired =
ceil(N * average / target)). The adapter rule that serves the metric is `adapter_rule()`;
`adapter_values()` gives the prometheus-adapter chart's `rules.custom` list for the
percentiles in use, e.g.:

    - seriesQuery: 'disagg_time_to_first_token_seconds_bucket{namespace!="",pod!=""}'
      resources: {overrides: {namespace: {resource: namespace}, pod: {resource: pod}}}
      name: {matches: "^disagg_time_to_first_token_seconds_bucket$",
             as: "disagg_time_to_first_token_p90_seconds"}
      metricsQuery: 'histogram_quantile(0.9, sum by (<<.GroupBy>>, le)
                     (rate(<<.Series>>{<<.LabelMatchers>>}[1m])))'

Stabilization windows and step limits map onto the HPA's `behavior`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from disagg.operator.autoscaling.scrape import LATENCY_METRIC
from disagg.operator.autoscaling.spec import AutoscalingSpec
from disagg.operator.builders import common

if TYPE_CHECKING:
    from disagg.operator.spec import InferenceDeployment


def adapter_metric_name(role: str, percentile: float) -> str:
    base = LATENCY_METRIC[role].removesuffix("_seconds")
    return f"{base}_p{percentile:g}_seconds".replace(".", "_")


def adapter_rule(role: str, percentile: float) -> dict:
    """One prometheus-adapter `rules.custom` entry serving the per-pod percentile."""
    series = LATENCY_METRIC[role] + "_bucket"
    q = percentile / 100.0
    return {
        "seriesQuery": f'{series}{{namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{series}$", "as": adapter_metric_name(role, percentile)},
        "metricsQuery": (
            f"histogram_quantile({q:g}, sum by (<<.GroupBy>>, le) (rate(<<.Series>>{{<<.LabelMatchers>>}}[1m])))"
        ),
    }


def adapter_values(percentiles: tuple[float, ...] = (90, 99)) -> dict:
    """prometheus-adapter chart values (`rules.custom`) for both roles at these percentiles."""
    return {"rules": {"custom": [adapter_rule(r, p) for r in ("prefill", "decode") for p in percentiles]}}


def _quantity(seconds: float) -> str:
    """A Kubernetes quantity for seconds, in milli-units so 0.25 s stays exact ("250m")."""
    millis = seconds * 1000
    return f"{round(millis)}m" if abs(millis - round(millis)) < 1e-9 else f"{round(millis * 1000)}u"


def _rules(stabilization: float, max_step: int | None, select: str) -> dict:
    rules: dict = {"stabilizationWindowSeconds": int(stabilization), "selectPolicy": select}
    if max_step is not None:
        rules["policies"] = [{"type": "Pods", "value": max_step, "periodSeconds": 60}]
    else:
        rules["policies"] = [{"type": "Percent", "value": 100, "periodSeconds": 15}]
    return rules


def build_hpa(idep: InferenceDeployment, role: str, target_ref: dict | None = None) -> dict:
    """The HorizontalPodAutoscaler for `role` of an InferenceDeployment (names, labels and owner
    reference as for every other child); `target_ref`: what it scales, the role's StatefulSet by
    default (a LeaderWorkerSet for a role spanning nodes: its scale subresource counts groups)."""
    spec: AutoscalingSpec | None = idep.spec.role(role).autoscaling
    if spec is None:
        raise ValueError(f"spec.{role}.autoscaling: is required to build an HPA")
    target = common.role_name(idep, role)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": common.metadata(idep, target, role),
        "spec": {
            "scaleTargetRef": target_ref or {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": target},
            "minReplicas": max(spec.min_replicas, 1),
            "maxReplicas": spec.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {
                            "name": adapter_metric_name(role, spec.percentile),
                            # The `role` label the workers put on their own series.
                            "selector": {"matchLabels": {"role": role}},
                        },
                        "target": {"type": "AverageValue", "averageValue": _quantity(spec.target_seconds)},
                    },
                }
            ],
            "behavior": {
                "scaleUp": _rules(spec.scale_up.stabilization_seconds, spec.scale_up.max_step, "Max"),
                "scaleDown": _rules(spec.scale_down.stabilization_seconds, spec.scale_down.max_step, "Min"),
            },
        },
    }
