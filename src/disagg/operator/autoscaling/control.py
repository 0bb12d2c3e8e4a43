"""The control law: (spec, replicas, observation, memory, now) -> decision. Pure, no I/O.

Shape (after Dynamo's planner, AIBrix's KPA and llm-d's saturation analyzer):
- load is a ratio against the role's limits: the latency percentile over its target, and a
  saturation signal the latency only shows late (prefill: waiting requests per replica;
  decode: KV-cache use, which ends in preemption);
- scale up as soon as the load exceeds 1 (after `scaleUp.stabilizationSeconds`, default 0),
  proportionally: ceil(N * load), at most doubling the pool and adding `scaleUp.maxStep` at
  once (queueing makes latency overshoot the capacity actually missing);
- scale down by `scaleDown.maxStep` (default 1) only when the load would still fit on fewer
  replicas with a margin (load * N / (N - k) <= 0.8) and has done so for the whole
  `scaleDown.stabilizationSeconds` (default 300). Each further step is judged on fresh metrics
  of the smaller pool (after it converged and settled) and needs the load to have kept fitting
  all along; any miss restarts the window. The gap between 0.8 and 1 is the hysteresis that
  keeps oscillating load from flapping the pool;
- nothing while the previous change converges (ready != replicas) or while the metrics window
  still covers the time before it converged: the numbers describe the old pool;
- missing or stale metrics: hold, and say so;
- always inside [minReplicas, maxReplicas].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from disagg.operator.autoscaling.spec import AutoscalingSpec


@dataclass(frozen=True)
class Tuning:
    down_margin: float = 0.8  # scale down only if the load on N-k replicas stays under this
    queue_per_replica: float = 8.0  # prefill: waiting requests per replica that count as full
    kv_high: float = 0.9  # decode: KV-cache use that counts as full (preemption follows)
    stale_after_seconds: float = 90.0  # an observation older than this is not acted on
    window_seconds: float = 60.0  # the metrics window; a change is judged only once it is past
    max_up_factor: float = 2.0  # one scale-up step at most doubles the pool


@dataclass(frozen=True)
class Observation:
    """What the metrics say about one role. `error` set means there is nothing to act on."""

    observed_at: float
    latency_seconds: float | None = None  # the target percentile; None: no request in the window
    samples: float = 0.0  # requests (prefill) or tokens (decode) observed in the window
    queue_waiting: float | None = None  # prefill: requests waiting, summed over the pool
    kv_usage: float | None = None  # decode: mean KV-cache use of the pool, 0..1
    source: str = ""
    error: str | None = None
    warming_up: bool = False  # the error is only that a window needs one more scrape


@dataclass(frozen=True)
class Memory:
    """What the law remembers between ticks (kept by the caller, returned updated)."""

    pressure_since: float | None = None  # load > 1 continuously since
    slack_since: float | None = None  # load fit on fewer replicas continuously since
    last_scale_time: float | None = None
    converged_at: float | None = None  # first tick with ready == replicas after a change


@dataclass(frozen=True)
class Decision:
    replicas: int  # desired replica count
    previous: int
    action: str  # up | down | hold | clamp
    code: str  # CamelCase reason, as in Kubernetes Events (ScaleUp, Converging, MetricsMissing, ...)
    reason: str
    memory: Memory
    load: float | None = None
    metric_seconds: float | None = None

    @property
    def changed(self) -> bool:
        return self.replicas != self.previous


def load_ratio(spec: AutoscalingSpec, obs: Observation, replicas: int, tuning: Tuning) -> tuple[float, str]:
    """The role's load as a fraction of what its pool can take, and what drives it."""
    latency = (obs.latency_seconds or 0.0) / spec.target_seconds
    parts = [(latency, f"{spec.metric_label} p{spec.percentile:g}")]
    if spec.role == "prefill" and obs.queue_waiting is not None:
        parts.append((obs.queue_waiting / (max(replicas, 1) * tuning.queue_per_replica), "queue"))
    if spec.role == "decode" and obs.kv_usage is not None:
        parts.append((obs.kv_usage / tuning.kv_high, "KV use"))
    return max(parts)


def describe(spec: AutoscalingSpec, obs: Observation, tuning: Tuning) -> str:
    """The observed values in words, for reasons and Events."""
    if obs.latency_seconds is None:
        text = f"{spec.metric_label} p{spec.percentile:g} n/a (no requests)"
    else:
        text = (
            f"{spec.metric_label} p{spec.percentile:g} {obs.latency_seconds * 1000:.0f}ms"
            f" vs target {spec.target_seconds * 1000:.0f}ms"
        )
    if spec.role == "prefill" and obs.queue_waiting is not None:
        text += f", {obs.queue_waiting:g} waiting"
    if spec.role == "decode" and obs.kv_usage is not None:
        text += f", KV use {obs.kv_usage:.0%}"
    return text


def decide(
    spec: AutoscalingSpec,
    replicas: int,
    ready: int,
    obs: Observation | None,
    memory: Memory,
    now: float,
    tuning: Tuning | None = None,
) -> Decision:
    tuning = tuning or Tuning()
    metric = obs.latency_seconds if obs is not None and obs.error is None else None

    def hold(code: str, reason: str, mem: Memory, load: float | None = None) -> Decision:
        return Decision(replicas, replicas, "hold", code, reason, mem, load, metric)

    def change(to: int, action: str, code: str, reason: str, load: float | None = None) -> Decision:
        # A step down keeps the slack clock: the next step needs only fresh metrics of the
        # smaller pool (settle), not another whole window, as long as the load keeps fitting.
        mem = Memory(last_scale_time=now, slack_since=memory.slack_since if action == "down" else None)
        return Decision(to, replicas, action, code, f"{reason}: {replicas} -> {to}", mem, load, metric)

    bounded = spec.clamp(replicas)
    if bounded != replicas:
        side = (
            f"minReplicas {spec.min_replicas}" if bounded > replicas else f"maxReplicas {spec.max_replicas}"
        )
        return change(bounded, "clamp", "OutsideBounds", f"outside bounds ({side})")

    # Converging: the previous change is not done; the metrics describe a pool that is going away.
    if ready != replicas:
        return hold("Converging", f"converging: {ready}/{replicas} ready", replace(memory, converged_at=None))
    if memory.last_scale_time is not None and memory.converged_at is None:
        memory = replace(memory, converged_at=now)

    if obs is not None and obs.error is not None and obs.warming_up:
        return hold(
            "WarmingUp", f"holding: {obs.error}", replace(memory, pressure_since=None, slack_since=None)
        )
    if obs is None or obs.error is not None:
        why = obs.error if obs is not None else "no reading yet"
        return hold(
            "MetricsMissing",
            f"holding: metrics missing ({why})",
            replace(memory, pressure_since=None, slack_since=None),
        )
    age = now - obs.observed_at
    if age > tuning.stale_after_seconds:
        return hold(
            "MetricsStale",
            f"holding: metrics stale ({age:.0f}s old > {tuning.stale_after_seconds:.0f}s)",
            replace(memory, pressure_since=None, slack_since=None),
        )
    if memory.converged_at is not None and now - memory.converged_at < tuning.window_seconds:
        return hold(
            "Settling",
            f"settling: the {tuning.window_seconds:.0f}s metrics window still covers the last change",
            replace(memory, pressure_since=None),
        )

    load, driver = load_ratio(spec, obs, replicas, tuning)
    seen = describe(spec, obs, tuning)

    if load > 1.0:
        since = memory.pressure_since if memory.pressure_since is not None else now
        memory = replace(memory, pressure_since=since, slack_since=None)
        if replicas >= spec.max_replicas:
            return hold("AtMaxReplicas", f"at maxReplicas {spec.max_replicas}: {seen}", memory, load)
        waited = now - since
        if waited < spec.scale_up.stabilization_seconds:
            return hold(
                "ScaleUpStabilizing",
                f"{driver} over limit ({seen}) for {waited:.0f}s of {spec.scale_up.stabilization_seconds:.0f}s",
                memory,
                load,
            )
        # Latency grows faster than linearly once a queue forms, so one step at most multiplies
        # the pool by max_up_factor; the next step comes on fresh metrics of the larger pool.
        want = max(replicas + 1, math.ceil(replicas * min(load, tuning.max_up_factor) - 1e-9))
        if spec.scale_up.max_step is not None:
            want = min(want, replicas + spec.scale_up.max_step)
        to = spec.clamp(want)
        return change(to, "up", "ScaleUp", f"{driver} over limit x{load:.2f} ({seen})", load)

    memory = replace(memory, pressure_since=None)
    if replicas <= spec.min_replicas:
        return hold(
            "AtMinReplicas",
            f"within target at minReplicas {spec.min_replicas}: {seen}",
            replace(memory, slack_since=None),
            load,
        )
    # The largest step down (up to maxStep) whose projected load keeps the margin.
    step = 0
    for k in range(1, (spec.scale_down.max_step or 1) + 1):
        if replicas - k < max(spec.min_replicas, 1):
            break
        if load * replicas / (replicas - k) <= tuning.down_margin:
            step = k
    if step == 0:
        projected = f"x{load * replicas / (replicas - 1):.2f}" if replicas > 1 else "load"
        return hold(
            "WithinTarget",
            f"within target ({seen}); would not fit on {replicas - 1} (projected {projected} > "
            f"{tuning.down_margin:g})",
            replace(memory, slack_since=None),
            load,
        )
    since = memory.slack_since if memory.slack_since is not None else now
    memory = replace(memory, slack_since=since)
    waited = now - since
    if waited < spec.scale_down.stabilization_seconds:
        return hold(
            "ScaleDownStabilizing",
            f"fits on {replicas - step} ({seen}) for {waited:.0f}s of {spec.scale_down.stabilization_seconds:.0f}s",
            memory,
            load,
        )
    return change(
        replicas - step, "down", "ScaleDown", f"load fits on fewer for {waited:.0f}s ({seen})", load
    )
