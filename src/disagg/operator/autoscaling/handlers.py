"""The kopf handlers that run the autoscaler.

A timer per InferenceDeployment, each tick, for each role with `autoscaling.mode: operator`:
read the metrics (PromQL when `metricsUrl` is set, else scrape the pods), run the control law,
write `status.<role>.autoscaling`, scale the StatefulSet, post an Event on every change, and
export the decision. The autoscaler alone owns an autoscaled StatefulSet's replicas (field
manager `disagg-autoscaler`; the operator's apply leaves them out once the StatefulSet exists).
A watch on the operator's StatefulSets undoes a change of them by anyone else at once (the
timer would too, one tick later), through `ownership.ReplicaOwner`, the one place that does so.
The status is written before the StatefulSet is scaled, under the same lock the revert takes.

Both use the operator's own API client (`disagg.operator.kube.Kube`), passed to `register`.

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

from disagg.operator import constants as c
from disagg.operator import events
from disagg.operator.autoscaling import prometheus
from disagg.operator.autoscaling.control import Decision, Observation, Tuning, decide
from disagg.operator.autoscaling.ownership import ReplicaOwner, owned_replicas
from disagg.operator.autoscaling.scrape import PoolScraper, pod_target
from disagg.operator.autoscaling.spec import (
    METRIC_LABEL,
    ROLES,
    AutoscalingSpec,
    AutoscalingSpecError,
    autoscaled_roles,
)
from disagg.operator.autoscaling.state import DeploymentState, role_status, worth_recording
from disagg.operator.autoscaling.telemetry import metrics
from disagg.operator.kube import Kube, label_selector, matches_labels

MANAGED_BY = {c.LABEL_MANAGED_BY: c.FIELD_MANAGER}
# What the autoscaler does through the API, for the chart's RBAC (group, resource, verb).
API_ACCESS = frozenset(
    {
        ("", "pods", "list"),
        *(("apps", "statefulsets", verb) for verb in ("get", "list", "watch", "patch")),
        ("disagg.dev", "inferencedeployments", "get"),
        ("disagg.dev", "inferencedeployments/status", "patch"),
        ("", "events", "create"),
    }
)
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


@dataclass
class Tick:
    """What one autoscaler tick works with (the I/O ends are replaceable)."""

    name: str
    namespace: str
    body: dict
    status: dict
    logger: logging.Logger | logging.LoggerAdapter
    owner: ReplicaOwner
    settings: Settings
    now: float
    events: Callable[..., None] = events.post

    @property
    def kube(self) -> Kube:
        return self.owner.kube


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
        await tick.kube.patch_status(
            c.API_VERSION, c.KIND, tick.namespace, tick.name, {r: {"autoscaling": None} for r in stale}
        )
        for r in stale:
            metrics().forget(tick.namespace, tick.name, r)
    if not roles:
        return {}
    state = _state(memo, tick.settings.tuning.window_seconds)
    decisions: dict[str, Decision] = {}
    async with aiohttp.ClientSession() as session:
        if any(not s.metrics_url for s in roles.values()):
            labels = {c.LABEL_DEPLOYMENT: tick.name}
            pods = await tick.kube.list("v1", "Pod", tick.namespace, label_selector(labels))
            # Filter here as well: not every API server (nor every test double) applies selectors.
            pods = [p for p in pods if matches_labels(p, labels)]
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


async def _tick_role(
    tick: Tick, role: str, aspec: AutoscalingSpec, state: DeploymentState, session
) -> Decision | None:
    sts_name = f"{tick.name}-{role}"
    obs = await _observe(tick, aspec, state, session)
    async with tick.owner.lock(tick.namespace, sts_name):
        # Read afresh under the lock the watch's revert takes: a change is written as status, then
        # replicas, and neither side may see one without the other.
        body = await tick.kube.get(c.API_VERSION, c.KIND, tick.namespace, tick.name)
        sts = await tick.kube.get("apps/v1", "StatefulSet", tick.namespace, sts_name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        if sts is None:
            tick.logger.info(f"autoscaler: StatefulSet {sts_name} not found yet; nothing to scale")
            return None
        reverted = await tick.owner.revert_locked(sts, body, tick.now)
        if reverted is not None:
            # Someone else changed the count: restored; judge the pool afresh from the next tick on.
            state.memories[role] = replace(state.memory(role, {}), pressure_since=None, slack_since=None)
            return reverted
        previous = dict(((body.get("status") or {}).get(role) or {}).get("autoscaling") or {})
        sts_replicas = (sts.get("spec") or {}).get("replicas")
        ready = int((sts.get("status") or {}).get("readyReplicas") or 0)
        owned = owned_replicas(body, role)
        current = (
            owned
            if owned is not None
            else int(sts_replicas if sts_replicas is not None else aspec.min_replicas)
        )
        memory = state.memory(role, previous)
        decision = decide(aspec, current, ready, obs, memory, tick.now, tick.settings.tuning)
        recorded = worth_recording(decision, list(previous.get("decisions") or []))
        await _write_status(tick, role, aspec, decision, state, previous)
        if decision.changed or owned is None:
            # The first decision also takes the field over from the operator's creation.
            await tick.owner.scale(sts, decision.replicas)
    label = METRIC_LABEL[role]
    if decision.changed:
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
        await tick.kube.patch_status(
            c.API_VERSION, c.KIND, tick.namespace, tick.name, {role: {"autoscaling": new}}
        )
    metrics().record(
        tick.namespace, tick.name, role, desired=decision.replicas, target=aspec.target_seconds,
        metric=decision.metric_seconds, load=decision.load, action=decision.action, code=decision.code,
    )  # fmt: skip


def register(
    registry: kopf.OperatorRegistry, *, kube: Kube, settings: Settings | None = None
) -> ReplicaOwner:
    """Register the timer, the hand-edit watch and the metrics server on a kopf registry.

    `kube` is the operator's client (configured by its login handler): one set of credentials.
    """
    settings = settings or Settings.from_env()
    owner = ReplicaOwner(kube)

    @kopf.timer(
        c.GROUP, c.VERSION, c.PLURAL, registry=registry, id="autoscaler", interval=settings.interval_seconds
    )
    async def autoscale_timer(name, namespace, memo, logger, **_):
        # Read the object fresh: the status must hold this process's last decision, and the
        # copy a timer is handed can lag behind the watch.
        body = await kube.get(c.API_VERSION, c.KIND, namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        tick = Tick(
            name, namespace, body, dict(body.get("status") or {}), logger, owner, settings, time.time()
        )
        await autoscale(tick, memo)

    @kopf.on.event(
        "apps", "v1", "statefulsets", registry=registry, id="autoscaler-replicas", labels=MANAGED_BY
    )
    async def statefulset_changed(body, event, **_):
        # None: listed at start-up (an edit made while the operator was down).
        role = ((body.get("metadata") or {}).get("labels") or {}).get(c.LABEL_ROLE)
        if event.get("type") in (None, "ADDED", "MODIFIED") and role in ROLES:
            await owner.revert_hand_edit(body["metadata"]["namespace"], body["metadata"]["name"])

    @kopf.on.startup(registry=registry, id="autoscaler-metrics")
    async def serve_autoscaler_metrics(logger, **_):
        if settings.metrics_port:
            try:
                prometheus_client.start_http_server(settings.metrics_port)
            except OSError as e:
                logger.warning(f"autoscaler metrics not served on :{settings.metrics_port}: {e}")

    return owner
