"""The kopf handlers that run the autoscaler.

A timer per InferenceDeployment, each tick, for each role with `autoscaling.mode: operator`:
read the metrics (PromQL when `metricsUrl` is set, else scrape the pods), restore the
StatefulSet's replicas if something else changed them, run the control law, write
`status.<role>.autoscaling`, scale the StatefulSet, post an Event on every change, and export
the decision. The status is written BEFORE the StatefulSet is scaled: the operator's
reconcile re-applies `status.<role>.autoscaling.desiredReplicas`, so it must never see a
scaled StatefulSet with the old number in the status.

A watch on the operator's StatefulSets reverts a hand edit of an autoscaled role's replicas
at once (the timer would too, one tick later), with an Event on the InferenceDeployment.

Settings (environment): DISAGG_AUTOSCALER_INTERVAL_SECONDS (15), DISAGG_AUTOSCALER_WINDOW_SECONDS
(60: the metrics window, and the settle time after a change), DISAGG_AUTOSCALER_STALE_SECONDS (90),
DISAGG_AUTOSCALER_METRICS_PORT (9090; 0 disables the autoscaler's own `/metrics` server).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import aiohttp
import kopf
import prometheus_client

from . import prometheus
from .control import Decision, Observation, Tuning, decide
from .kube import KopfKube
from .scrape import DEPLOYMENT_LABEL, ROLE_LABEL, PoolScraper, pod_target
from .spec import METRIC_LABEL, ROLES, AutoscalingSpec, AutoscalingSpecError, autoscaled_roles
from .state import DeploymentState, role_status, worth_recording
from .telemetry import metrics

GROUP, VERSION, PLURAL = "disagg.dev", "v1alpha1", "inferencedeployments"
MANAGED_BY = {"app.kubernetes.io/managed-by": "disagg-operator"}
# Codes worth a Warning Event the first time they appear (a change always gets an Event).
WARN_CODES = {"MetricsMissing", "MetricsStale", "AtMaxReplicas"}


@dataclass(frozen=True)
class Settings:
    interval_seconds: float = 15.0
    tuning: Tuning = field(default_factory=Tuning)
    metrics_port: int = 9090

    @classmethod
    def from_env(cls, env=os.environ) -> Settings:
        def number(key: str, default: float) -> float:
            raw = env.get(key)
            if raw is None or raw == "":
                return default
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"{key}: must be a number, got {raw!r}") from None
            if value < 0:
                raise ValueError(f"{key}: must be >= 0, got {raw!r}")
            return value

        window = number("DISAGG_AUTOSCALER_WINDOW_SECONDS", Tuning.window_seconds)
        return cls(
            interval_seconds=number("DISAGG_AUTOSCALER_INTERVAL_SECONDS", 15.0) or 15.0,
            tuning=Tuning(
                window_seconds=window,
                stale_after_seconds=number("DISAGG_AUTOSCALER_STALE_SECONDS", Tuning.stale_after_seconds),
            ),
            metrics_port=int(number("DISAGG_AUTOSCALER_METRICS_PORT", 9090)),
        )


def post_event(body, type: str, reason: str, message: str) -> None:
    """An Event on the InferenceDeployment (kopf.event: not filtered by the posting level)."""
    kopf.event(body, type=type, reason=reason, message=message)


@dataclass
class Tick:
    """What one autoscaler tick works with (the I/O ends are replaceable)."""

    name: str
    namespace: str
    body: dict
    status: dict
    logger: logging.Logger | logging.LoggerAdapter
    kube: KopfKube
    settings: Settings
    now: float
    events: Callable[..., None] = post_event


def _state(memo, window: float) -> DeploymentState:
    state = memo.get("disagg_autoscaler")
    if state is None:
        state = DeploymentState(PoolScraper(window_seconds=window))
        memo["disagg_autoscaler"] = state
    return state


async def autoscale(tick: Tick, memo) -> dict[str, Decision]:
    """One autoscaler tick for one InferenceDeployment; returns the decisions by role."""
    spec = dict(tick.body.get("spec") or {})
    try:
        roles = {r: s for r, s in autoscaled_roles(spec).items() if s.mode == "operator"}
    except AutoscalingSpecError as e:
        tick.events(tick.body, "Warning", "InvalidAutoscaling", str(e))
        tick.logger.warning(f"autoscaling not applied: {e}")
        return {}
    stale = [r for r in ROLES if r not in roles and (tick.status.get(r) or {}).get("autoscaling") is not None]
    if stale:
        # A role no longer autoscaled by the operator: drop its status and series.
        await tick.kube.patch_status(tick.namespace, tick.name, {r: {"autoscaling": None} for r in stale})
        for r in stale:
            metrics().forget(tick.namespace, tick.name, r)
    if not roles:
        return {}
    state = _state(memo, tick.settings.tuning.window_seconds)
    decisions: dict[str, Decision] = {}
    async with aiohttp.ClientSession() as session:
        if any(not s.metrics_url for s in roles.values()):
            pods = await tick.kube.list_pods(tick.namespace, {DEPLOYMENT_LABEL: tick.name})
            targets = [t for t in map(pod_target, pods) if t is not None]
            await state.scraper.scrape(targets, tick.now, session)
        for role, aspec in roles.items():
            decision = await _tick_role(tick, role, aspec, state, session)
            if decision is not None:
                decisions[role] = decision
    return decisions


async def _observe(tick: Tick, spec: AutoscalingSpec, state: DeploymentState, session) -> Observation:
    if spec.metrics_url:
        window = tick.settings.tuning.window_seconds
        return await prometheus.observe(session, spec, tick.namespace, tick.name, tick.now, window)
    return state.scraper.observe(spec, tick.now)


def revert_message(role: str, sts_name: str, found: int, restored: int) -> str:
    return (
        f"replicas of StatefulSet {sts_name} were changed to {found} outside the autoscaler; restored "
        f"{restored}: spec.{role}.autoscaling owns the replica count (edit its minReplicas/maxReplicas, "
        f"or replace autoscaling with replicas, to size this pool by hand)"
    )


async def _tick_role(
    tick: Tick, role: str, aspec: AutoscalingSpec, state: DeploymentState, session
) -> Decision | None:
    previous = dict((tick.status.get(role) or {}).get("autoscaling") or {})
    sts_name = f"{tick.name}-{role}"
    sts = await tick.kube.get_statefulset(tick.namespace, sts_name)
    if sts is None:
        tick.logger.info(f"autoscaler: StatefulSet {sts_name} not found yet; nothing to scale")
        return None
    sts_replicas = (sts.get("spec") or {}).get("replicas")
    ready = int((sts.get("status") or {}).get("readyReplicas") or 0)
    owned = previous.get("desiredReplicas")
    memory = state.memory(role, previous)

    if owned is not None and sts_replicas is not None and sts_replicas != owned:
        # Someone else changed the count: the autoscaler is its only owner while autoscaling is on.
        restored = aspec.clamp(int(owned))
        reason = revert_message(role, sts_name, int(sts_replicas), restored)
        decision = Decision(
            restored, int(sts_replicas), "revert", "ReplicasReverted", reason,
            replace(memory, pressure_since=None, slack_since=None),
        )  # fmt: skip
        await _write_status(tick, role, aspec, decision, state, previous, record=True)
        await tick.kube.scale_statefulset(tick.namespace, sts_name, restored)
        tick.events(tick.body, "Warning", "ReplicasReverted", reason)
        return decision

    current = (
        int(owned)
        if owned is not None
        else int(sts_replicas if sts_replicas is not None else aspec.min_replicas)
    )
    obs = await _observe(tick, aspec, state, session)
    decision = decide(aspec, current, ready, obs, memory, tick.now, tick.settings.tuning)
    recorded = worth_recording(decision, list(previous.get("decisions") or []))
    await _write_status(tick, role, aspec, decision, state, previous)
    label = METRIC_LABEL[role]
    if decision.changed:
        await tick.kube.scale_statefulset(tick.namespace, sts_name, decision.replicas)
        tick.events(tick.body, "Normal", f"Scaled{role.capitalize()}", f"{role} ({label}): {decision.reason}")
        tick.logger.info(f"autoscaler: {role} {decision.reason}")
    elif decision.code in WARN_CODES and recorded:
        tick.events(tick.body, "Warning", decision.code, f"{role} ({label}): {decision.reason}")
    tick.logger.debug(f"autoscaler: {role} via {obs.source}: {decision.reason}")
    return decision


async def _write_status(tick: Tick, role, aspec, decision: Decision, state, previous, record=None) -> None:
    state.memories[role] = decision.memory
    new = role_status(aspec, decision, previous, tick.now, record=record)
    if new != previous:
        await tick.kube.patch_status(tick.namespace, tick.name, {role: {"autoscaling": new}})
    metrics().record(
        tick.namespace, tick.name, role, desired=decision.replicas, target=aspec.target_seconds,
        metric=decision.metric_seconds, load=decision.load, action=decision.action, code=decision.code,
    )  # fmt: skip


async def revert_hand_edit(sts: dict, kube: KopfKube, events: Callable[..., None] = post_event) -> bool:
    """If `sts` is an autoscaled role's StatefulSet whose replicas differ from the autoscaler's
    decision, restore them and say why on the InferenceDeployment. True when it did."""
    meta = sts.get("metadata") or {}
    labels = meta.get("labels") or {}
    role, name, namespace = labels.get(ROLE_LABEL), labels.get(DEPLOYMENT_LABEL), meta.get("namespace")
    replicas = (sts.get("spec") or {}).get("replicas")
    if role not in ROLES or not name or replicas is None or meta.get("deletionTimestamp"):
        return False
    idep = await kube.get_deployment(namespace, name)
    if idep is None or (idep.get("metadata") or {}).get("deletionTimestamp"):
        return False
    try:
        aspec = autoscaled_roles(idep.get("spec") or {}).get(role)
    except AutoscalingSpecError:
        return False  # the timer reports a bad section
    owned = (((idep.get("status") or {}).get(role) or {}).get("autoscaling") or {}).get("desiredReplicas")
    if aspec is None or aspec.mode != "operator" or owned is None or int(owned) == int(replicas):
        return False
    restored = aspec.clamp(int(owned))
    await kube.scale_statefulset(namespace, meta["name"], restored)
    events(idep, "Warning", "ReplicasReverted", revert_message(role, meta["name"], int(replicas), restored))
    return True


def register(registry: kopf.OperatorRegistry | None = None, settings: Settings | None = None) -> None:
    """Register the timer, the hand-edit watch and the metrics server on a kopf registry."""
    settings = settings or Settings.from_env()
    kwargs = {"registry": registry} if registry is not None else {}

    async def autoscale_timer(name, namespace, memo, logger, **_):
        kube = KopfKube(logger)
        # Read the object fresh: the status must hold this process's last decision, and the
        # copy a timer is handed can lag behind the watch.
        body = await kube.get_deployment(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        tick = Tick(
            name, namespace, body, dict(body.get("status") or {}), logger, kube, settings, time.time()
        )
        await autoscale(tick, memo)

    async def statefulset_changed(body, event, logger, **_):
        if event.get("type") in ("ADDED", "MODIFIED"):
            await revert_hand_edit(dict(body), KopfKube(logger))

    async def serve_autoscaler_metrics(logger, **_):
        if settings.metrics_port:
            try:
                prometheus_client.start_http_server(settings.metrics_port)
            except OSError as e:
                logger.warning(f"autoscaler metrics not served on :{settings.metrics_port}: {e}")

    kopf.timer(GROUP, VERSION, PLURAL, id="autoscaler", interval=settings.interval_seconds, **kwargs)(
        autoscale_timer
    )
    kopf.on.event("apps", "v1", "statefulsets", id="autoscaler-replicas", labels=MANAGED_BY, **kwargs)(
        statefulset_changed
    )
    kopf.on.startup(id="autoscaler-metrics", **kwargs)(serve_autoscaler_metrics)


if os.environ.get("DISAGG_AUTOSCALER_DISABLED", "") not in ("1", "true"):
    register()
