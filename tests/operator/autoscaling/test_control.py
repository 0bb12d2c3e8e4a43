"""Table tests of the control law, driven by a small closed-loop model of a pool.

The model: `demand` is the load in replicas-at-target, so N replicas see a latency of
target * demand / N. Ready follows replicas after `startup` seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from disagg.operator.autoscaling.control import Memory, Observation, Tuning, decide
from disagg.operator.autoscaling.spec import parse_autoscaling

TICK = 15.0
TUNING = Tuning()


def prefill(**over):
    raw = {"minReplicas": 1, "maxReplicas": 8, "target": {"ttftMilliseconds": 500}}
    raw.update(over)
    return parse_autoscaling("prefill", raw)


def decode(**over):
    raw = {"minReplicas": 1, "maxReplicas": 8, "target": {"itlMilliseconds": 50}}
    raw.update(over)
    return parse_autoscaling("decode", raw)


@dataclass
class Trace:
    replicas: list[int]
    changes: list[tuple[float, int, int, str]]
    codes: list[str]


def run(spec, demand, seconds, replicas=1, startup=0.0, t0=0.0):
    """Step the law every TICK seconds against the pool model; return what it did."""
    memory = Memory()
    ready, ready_at = replicas, t0
    trace = Trace([], [], [])
    t = t0
    while t < t0 + seconds:
        if t >= ready_at:
            ready = replicas
        d = demand(t)
        latency = spec.target_seconds * d / replicas if d > 0 else None
        obs = Observation(
            observed_at=t, latency_seconds=latency, samples=100 if d > 0 else 0, queue_waiting=0
        )
        dec = decide(spec, replicas, ready, obs, memory, t, TUNING)
        memory = dec.memory
        trace.codes.append(dec.code)
        if dec.changed:
            trace.changes.append((t, dec.previous, dec.replicas, dec.reason))
            replicas, ready_at = dec.replicas, t + startup
        trace.replicas.append(replicas)
        t += TICK
    return trace


def test_step_up_is_immediate_and_proportional():
    trace = run(prefill(), lambda t: 0.5 if t < 300 else 3.6, 1200, replicas=2)
    assert trace.changes[0][:3] == (300.0, 2, 4)  # ceil(2 * 0.9 / 0.5), at the first tick over target
    assert "TTFT p90 900ms vs target 500ms" in trace.changes[0][3]
    assert len(trace.changes) == 1 and trace.replicas[-1] == 4


def test_step_up_at_most_doubles_then_looks_again():
    trace = run(prefill(), lambda t: 0.5 if t < 300 else 3.0, 1200)
    assert [c[:3] for c in trace.changes] == [(300.0, 1, 2), (375.0, 2, 3)]  # x3 wanted: x2, then settle
    assert trace.replicas[-1] == 3  # at 3 the load is exactly at target


def test_step_down_waits_the_window_and_goes_one_step_at_a_time():
    trace = run(prefill(), lambda t: 4.0 if t < 300 else 0.5, 2400, replicas=4, startup=30)
    downs = [c for c in trace.changes if c[2] < c[1]]
    assert [(a, b) for _, a, b, _ in downs] == [(4, 3), (3, 2), (2, 1)]
    assert downs[0][0] >= 300 + 300  # not before scaleDown.stabilizationSeconds of slack
    # Each further step waits for the smaller pool to be ready and measured (startup + window).
    assert all(b[0] - a[0] >= 30 + TUNING.window_seconds for a, b in zip(downs, downs[1:], strict=False))
    assert "load fits on fewer" in downs[0][3]


def test_a_load_rise_between_steps_restarts_the_window():
    # Walking down from 4 when the load rises for 200 s; after it falls, a whole window again.
    trace = run(prefill(), lambda t: 2.2 if 400 <= t < 600 else 0.5, 3000, replicas=4)
    downs = [c[0] for c in trace.changes if c[2] < c[1]]
    ups = [c[0] for c in trace.changes if c[2] > c[1]]
    assert downs[0] == 300 and ups and 400 <= ups[0] < 600
    assert all(t >= 600 + 300 for t in downs if t > ups[0])


def test_ramp_grows_monotonically_within_bounds():
    trace = run(prefill(), lambda t: 0.5 + 6.0 * min(t, 1800) / 1800, 2400)
    assert trace.replicas == sorted(trace.replicas)  # never shrinks while load rises
    assert trace.replicas[-1] in (7, 8)  # demand 6.5 at target: 7 replicas, or 8 after a proportional step
    assert max(trace.replicas) <= 8


def test_spike_doubles_to_max_then_walks_down():
    trace = run(prefill(), lambda t: 20.0 if 300 <= t < 600 else 1.0, 3600, startup=30)
    ups = [c[:3] for c in trace.changes if c[2] > c[1]]
    # Doubling each time the larger pool is ready and measured: 30 s startup + 60 s window.
    assert ups == [(300.0, 1, 2), (390.0, 2, 4), (480.0, 4, 8)]
    downs = [c for c in trace.changes if c[2] < c[1]]
    assert downs and all(b == a - 1 for _, a, b, _ in downs)
    assert downs[0][0] >= 600 + 300  # the spike's end, then a whole scale-down window
    assert trace.replicas[-1] == 2  # demand 1.0 on 1 replica would not keep the 0.8 margin


@pytest.mark.parametrize("low, high", [(1.3, 1.9), (1.5, 2.5)])
def test_oscillating_load_does_not_flap(low, high):
    # Period 120 s: shorter than the scale-down window, so slack never lasts long enough.
    trace = run(prefill(), lambda t: high if (t // 60) % 2 else low, 3600, replicas=2)
    assert len(trace.changes) <= 1
    assert all(b > a for _, a, b, _ in trace.changes)  # at most one step up, never down


def test_missing_and_stale_metrics_hold_and_say_so():
    spec = prefill()
    missing = decide(
        spec, 3, 3, Observation(100.0, error="no prefill or router pod answered"), Memory(), 100.0
    )
    assert (missing.action, missing.code, missing.replicas) == ("hold", "MetricsMissing", 3)
    assert "metrics missing (no prefill or router pod answered)" in missing.reason
    none = decide(spec, 3, 3, None, Memory(), 100.0)
    assert none.code == "MetricsMissing"
    stale = decide(spec, 3, 3, Observation(0.0, latency_seconds=5.0, samples=9), Memory(), 500.0)
    assert (stale.code, stale.replicas) == ("MetricsStale", 3) and "500s old" in stale.reason


def test_missing_metrics_restart_the_scale_down_window():
    spec = prefill()
    idle = Observation(0.0, latency_seconds=0.05, samples=10, queue_waiting=0)
    mem = decide(spec, 3, 3, idle, Memory(), 0.0).memory
    assert mem.slack_since == 0.0
    mem = decide(spec, 3, 3, Observation(200.0, error="scrape failed"), mem, 200.0).memory
    later = decide(spec, 3, 3, Observation(310.0, latency_seconds=0.05, samples=10), mem, 310.0)
    assert later.action == "hold" and later.code == "ScaleDownStabilizing"


def test_bounds():
    spec = prefill(minReplicas=2, maxReplicas=4)
    over = Observation(0.0, latency_seconds=10.0, samples=50)
    assert decide(spec, 6, 6, over, Memory(), 0.0).replicas == 4  # clamp, even under load
    assert decide(spec, 1, 1, None, Memory(), 0.0).replicas == 2  # clamp, even without metrics
    at_max = decide(spec, 4, 4, over, Memory(), 0.0)
    assert (at_max.code, at_max.replicas) == ("AtMaxReplicas", 4)
    up = decide(spec, 3, 3, over, Memory(), 0.0)
    assert up.replicas == 4
    idle = Observation(0.0, latency_seconds=None, samples=0, queue_waiting=0)
    at_min = decide(spec, 2, 2, idle, Memory(slack_since=-1e6), 0.0)
    assert (at_min.code, at_min.replicas) == ("AtMinReplicas", 2)


def test_convergence_guard_then_settle_then_act():
    spec = prefill()

    def over(t):
        return Observation(t, latency_seconds=2.0, samples=50)

    first = decide(spec, 2, 2, over(1000.0), Memory(), 1000.0)
    assert first.replicas == 4  # x4 over target, one step at most doubles
    converging = decide(spec, 4, 3, over(1015.0), first.memory, 1015.0)
    assert (converging.code, converging.replicas) == ("Converging", 4)
    assert "3/4 ready" in converging.reason
    settled = decide(spec, 4, 4, over(1100.0), converging.memory, 1100.0)
    assert settled.code == "Settling"  # the window still holds latencies of the 2-replica pool
    t = 1100.0 + TUNING.window_seconds
    again = decide(spec, 4, 4, over(t), settled.memory, t)
    assert (again.action, again.replicas) == ("up", 8)
    t += TUNING.window_seconds
    assert decide(spec, 8, 8, over(t), Memory(), t).code == "AtMaxReplicas"


def test_idle_pool_scales_down():
    trace = run(prefill(), lambda t: 0.0, 1300, replicas=3)
    assert [(a, b) for _, a, b, _ in trace.changes] == [(3, 2), (2, 1)]


def test_prefill_queue_depth_scales_up_before_ttft_misses():
    spec = prefill()
    obs = Observation(0.0, latency_seconds=0.3, samples=20, queue_waiting=48)  # 24 per replica vs 8
    d = decide(spec, 2, 2, obs, Memory(), 0.0)
    assert (d.action, d.replicas) == ("up", 4) and d.reason.startswith("queue over limit x3.00")


def test_decode_kv_use_scales_up_and_blocks_scale_down():
    spec = decode()
    full = decide(
        spec, 2, 2, Observation(0.0, latency_seconds=0.02, samples=500, kv_usage=0.99), Memory(), 0.0
    )
    assert full.action == "up" and full.replicas == 3 and "KV use 99%" in full.reason
    # ITL is far under target but KV use would not fit on one replica fewer.
    busy = decide(
        spec,
        2,
        2,
        Observation(0.0, latency_seconds=0.01, samples=500, kv_usage=0.5),
        Memory(slack_since=-1e6),
        0.0,
    )
    assert busy.code == "WithinTarget" and "would not fit on 1" in busy.reason


def test_scale_up_stabilization_and_max_step():
    spec = prefill(scaleUp={"stabilizationSeconds": 30, "maxStep": 2})

    def over(t):
        return Observation(t, latency_seconds=5.0, samples=50)

    d = decide(spec, 3, 3, over(0.0), Memory(), 0.0)
    assert d.code == "ScaleUpStabilizing"
    d = decide(spec, 3, 3, over(15.0), d.memory, 15.0)
    assert d.code == "ScaleUpStabilizing" and "for 15s of 30s" in d.reason
    d = decide(spec, 3, 3, over(30.0), d.memory, 30.0)
    assert (d.action, d.replicas) == ("up", 5)  # x10 wanted, doubling allows 6, maxStep 2


def test_scale_down_max_step_takes_the_largest_step_that_fits():
    spec = prefill(scaleDown={"stabilizationSeconds": 0, "maxStep": 3})
    d = decide(spec, 8, 8, Observation(0.0, latency_seconds=0.1, samples=50), Memory(), 0.0)
    # load 0.2 on 8: 8 -> 5 projects 0.32, the largest step allowed (3).
    assert (d.action, d.replicas) == ("down", 5)
    d = decide(spec, 4, 4, Observation(0.0, latency_seconds=0.3, samples=50), Memory(), 0.0)
    # load 0.6 on 4 -> 3 projects 0.8 (fits), -> 2 projects 1.2 (does not).
    assert (d.action, d.replicas) == ("down", 3)


def test_proportional_step_matches_the_miss():
    for ratio, n, want in [(1.01, 4, 5), (1.5, 4, 6), (2.0, 3, 6), (3.3, 2, 4), (1.9, 5, 8)]:
        obs = Observation(0.0, latency_seconds=0.5 * ratio, samples=10)
        d = decide(prefill(), n, n, obs, Memory(), 0.0)
        assert d.replicas == min(8, max(n + 1, math.ceil(n * min(ratio, 2.0)))) == want
