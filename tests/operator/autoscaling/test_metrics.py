"""Histogram arithmetic against prometheus-client's own exposition."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from disagg.operator.autoscaling.metrics import Histogram as H
from disagg.operator.autoscaling.metrics import merge, parse_exposition, quantile

BUCKETS = (0.1, 0.2, 0.5, 1.0, 2.0)
INF = math.inf


def exposition(observations, waiting=0.0, role="prefill"):
    reg = CollectorRegistry()
    h = Histogram(
        "disagg_time_to_first_token_seconds", "ttft", ("role", "model"), buckets=BUCKETS, registry=reg
    )
    g = Gauge("disagg_num_requests_waiting", "waiting", ("role", "model"), registry=reg)
    for v in observations:
        h.labels(role=role, model="m").observe(v)
    g.labels(role=role, model="m").set(waiting)
    return generate_latest(reg).decode()


def test_parse_and_quantile_like_histogram_quantile():
    page = parse_exposition(exposition([0.05] * 50 + [0.3] * 40 + [1.5] * 10, waiting=7))
    hist = page.histogram("disagg_time_to_first_token_seconds", role="prefill")
    assert hist.count == 100 and hist.sum == pytest.approx(0.05 * 50 + 0.3 * 40 + 1.5 * 10)
    # rank 50 lands at the top of the first bucket; rank 90 at the top of (0.2, 0.5].
    assert quantile(0.5, hist) == pytest.approx(0.1)
    assert quantile(0.9, hist) == pytest.approx(0.5)
    # rank 95: half way through the (1.0, 2.0] bucket, interpolated linearly as PromQL does.
    assert quantile(0.95, hist) == pytest.approx(1.5)
    assert page.gauge_values("disagg_num_requests_waiting", role="prefill") == [7.0]
    assert page.histogram("disagg_time_to_first_token_seconds", role="decode") is None


def test_inf_bucket_reports_the_largest_finite_bound():
    hist = H(((0.1, 0), (0.2, 0), (INF, 5)))
    assert quantile(0.9, hist) == 0.2


def test_no_observations_is_none():
    assert quantile(0.9, H(((0.1, 0), (INF, 0)))) is None
    assert quantile(0.9, None) is None
    with pytest.raises(ValueError, match="quantile"):
        quantile(1.5, H(((INF, 1),)))


def test_window_is_the_difference_of_cumulative_counts():
    old = parse_exposition(exposition([0.05] * 1000)).histogram("disagg_time_to_first_token_seconds")
    new = parse_exposition(exposition([0.05] * 1000 + [1.5] * 10)).histogram(
        "disagg_time_to_first_token_seconds"
    )
    # Cumulatively the slow requests are 1%; in the window they are all there is.
    assert quantile(0.9, new) < 0.1
    window = new.minus(old)
    assert window.count == 10 and quantile(0.5, window) == pytest.approx(1.5)


def test_counter_reset_counts_everything_since_the_restart():
    old = H(((0.1, 500), (INF, 600)), 30.0)
    restarted = H(((0.1, 2), (INF, 4)), 1.0)
    assert restarted.minus(old) == restarted


def test_merge_sums_pods_bucket_by_bucket():
    a = H(((0.1, 10), (0.5, 10), (INF, 10)))  # a fast pod
    b = H(((0.1, 0), (0.5, 10), (INF, 10)))  # a slow pod
    both = merge([a, b])
    assert both.count == 20
    assert quantile(0.9, both) == pytest.approx(0.1 + 0.4 * (18 - 10) / 10)
    assert merge([]) is None


def test_merge_of_different_layouts_uses_each_step_function():
    a = H(((0.1, 4), (INF, 4)))
    b = H(((0.2, 6), (INF, 6)))
    both = merge([a, b])
    assert both.buckets == ((0.1, 4), (0.2, 10), (INF, 10))
