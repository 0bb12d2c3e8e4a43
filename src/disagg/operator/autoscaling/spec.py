"""The `spec.<role>.autoscaling` section of an InferenceDeployment, parsed and validated.

The CRD applies the same defaults and CEL rules at admission. The autoscaler must not act on a
resource the API server never validated (kmock, old CRDs), so parsing fills the defaults and
checks the types itself, and runs the CRD's CEL rules through their one mirror
(`disagg.operator.rules`); every error names the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.operator import rules
from disagg.operator.constants import ROLES

# Which latency each role is responsible for, and the CRD field that names its target.
TARGET_FIELD = {"prefill": "ttftMilliseconds", "decode": "itlMilliseconds"}
METRIC_LABEL = {"prefill": "TTFT", "decode": "ITL"}
MODES = ("operator", "hpa")


class AutoscalingSpecError(ValueError):
    """A bad autoscaling section; the message starts with the field's path."""


@dataclass(frozen=True)
class ScalePolicy:
    stabilization_seconds: float
    max_step: int | None  # None: no limit besides maxReplicas


@dataclass(frozen=True)
class AutoscalingSpec:
    role: str
    min_replicas: int
    max_replicas: int
    target_seconds: float  # TTFT for prefill, ITL for decode
    percentile: float  # 50 <= p <= 99.99, as the CRD allows
    scale_up: ScalePolicy
    scale_down: ScalePolicy
    mode: str = "operator"
    metrics_url: str | None = None

    @property
    def metric_label(self) -> str:
        return METRIC_LABEL[self.role]

    @property
    def quantile(self) -> float:
        return self.percentile / 100.0

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


def _int(raw: dict, key: str, path: str, *, default=None, minimum: int = 0) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise AutoscalingSpecError(f"{path}.{key}: must be an integer, got {value!r}")
    if value < minimum:
        raise AutoscalingSpecError(f"{path}.{key}: must be >= {minimum}, got {value}")
    return value


def _number(raw: dict, key: str, path: str, *, default=None) -> float | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AutoscalingSpecError(f"{path}.{key}: must be a number, got {value!r}")
    return float(value)


def _section(raw: dict, key: str, path: str) -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise AutoscalingSpecError(f"{path}.{key}: must be an object, got {value!r}")
    return value


def _policy(raw: dict, path: str, *, stabilization: float, max_step: int | None) -> ScalePolicy:
    seconds = _number(raw, "stabilizationSeconds", path, default=stabilization)
    if seconds < 0:
        raise AutoscalingSpecError(f"{path}.stabilizationSeconds: must be >= 0, got {seconds:g}")
    return ScalePolicy(seconds, _int(raw, "maxStep", path, default=max_step, minimum=1))


def parse_autoscaling(role: str, raw: dict, path: str | None = None) -> AutoscalingSpec:
    """Validate `spec.<role>.autoscaling` and fill in the CRD's defaults."""
    if role not in ROLES:
        raise AutoscalingSpecError(f"role: must be one of {ROLES}, got {role!r}")
    path = path or f"spec.{role}.autoscaling"
    if not isinstance(raw, dict):
        raise AutoscalingSpecError(f"{path}: must be an object, got {raw!r}")
    min_replicas = _int(raw, "minReplicas", path, default=1, minimum=1)
    max_replicas = _int(raw, "maxReplicas", path, minimum=1)
    if max_replicas is None:
        raise AutoscalingSpecError(f"{path}.maxReplicas: is required")
    target = _section(raw, "target", path)
    # min <= max, and the role's own target (and only it): the CEL rules, from their one mirror.
    for problem in rules.violations({"spec": {role: {"autoscaling": raw}}}):
        raise AutoscalingSpecError(problem)
    field = TARGET_FIELD[role]
    millis = _number(target, field, f"{path}.target")
    if millis <= 0:
        raise AutoscalingSpecError(f"{path}.target.{field}: must be > 0, got {millis:g}")
    percentile = _number(target, "percentile", f"{path}.target", default=90)
    if not 50 <= percentile <= 99.99:
        raise AutoscalingSpecError(
            f"{path}.target.percentile: must be between 50 and 99.99, got {percentile:g}"
        )
    mode = raw.get("mode", "operator")
    if mode not in MODES:
        raise AutoscalingSpecError(f"{path}.mode: must be one of {MODES}, got {mode!r}")
    url = raw.get("metricsUrl")
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
        raise AutoscalingSpecError(f"{path}.metricsUrl: must be an http(s) URL, got {url!r}")
    return AutoscalingSpec(
        role=role,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        target_seconds=millis / 1000.0,
        percentile=percentile,
        scale_up=_policy(_section(raw, "scaleUp", path), f"{path}.scaleUp", stabilization=0, max_step=None),
        scale_down=_policy(
            _section(raw, "scaleDown", path), f"{path}.scaleDown", stabilization=300, max_step=1
        ),
        mode=mode,
        metrics_url=url or None,
    )


def autoscaled_roles(spec: dict) -> dict[str, AutoscalingSpec]:
    """Every role of an InferenceDeployment spec that has an autoscaling section, parsed."""
    found = {}
    for role in ROLES:
        section = (spec.get(role) or {}).get("autoscaling")
        if not section:
            continue
        found[role] = parse_autoscaling(role, section)
    return found
