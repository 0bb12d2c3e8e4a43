"""The autoscaler's own Prometheus metrics: what it saw, what it wanted, and why."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

LABELS = ("namespace", "deployment", "role")


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self.desired = Gauge(
            "disagg_autoscaler_desired_replicas",
            "Replicas the autoscaler wants for the role.",
            LABELS,
            registry=registry,
        )
        self.current_metric = Gauge(
            "disagg_autoscaler_metric_seconds",
            "Latency the autoscaler last measured at the target percentile (TTFT prefill, ITL decode).",
            LABELS,
            registry=registry,
        )
        self.target = Gauge(
            "disagg_autoscaler_target_seconds", "Latency target of the role.", LABELS, registry=registry
        )
        self.load = Gauge(
            "disagg_autoscaler_load_ratio",
            "Load of the role as a fraction of its limits (1 = at target).",
            LABELS,
            registry=registry,
        )
        self.decisions = Counter(
            "disagg_autoscaler_decisions",
            "Autoscaler decisions by action (up, down, hold, clamp, revert) and reason code.",
            (*LABELS, "action", "reason"),
            registry=registry,
        )

    def record(
        self,
        namespace: str,
        deployment: str,
        role: str,
        *,
        desired: int,
        target: float,
        metric: float | None,
        load: float | None,
        action: str,
        code: str,
    ) -> None:
        lab = {"namespace": namespace, "deployment": deployment, "role": role}
        self.desired.labels(**lab).set(desired)
        self.target.labels(**lab).set(target)
        self.current_metric.labels(**lab).set(float("nan") if metric is None else metric)
        self.load.labels(**lab).set(float("nan") if load is None else load)
        self.decisions.labels(**lab, action=action, reason=code).inc()

    def forget(self, namespace: str, deployment: str, role: str) -> None:
        """Drop a deleted deployment's series so they do not linger at their last value."""
        for gauge in (self.desired, self.current_metric, self.target, self.load):
            try:
                gauge.remove(namespace, deployment, role)
            except KeyError:
                pass


_METRICS: AutoscalerMetrics | None = None


def metrics() -> AutoscalerMetrics:
    """The process-wide instance (metric names can be registered once per registry)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = AutoscalerMetrics()
    return _METRICS
