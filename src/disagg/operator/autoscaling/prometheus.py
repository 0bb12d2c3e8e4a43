"""The metrics reader over a Prometheus HTTP API (`autoscaling.metricsUrl`).

Series are selected with the labels every Kubernetes scrape config adds (`namespace`, `pod`)
plus the `role` label the workers and router put on their own series, so no relabeling rule
is required. Pod names follow the operator's children: `<name>-router-*` (Deployment),
`<name>-prefill-N`, `<name>-decode-N` (StatefulSets).

An empty result means Prometheus has no such series (missing: hold); NaN from
`histogram_quantile` means the series exist but nothing was observed in the window (idle).
"""

from __future__ import annotations

import math

import aiohttp

from disagg.operator.autoscaling.control import Observation
from disagg.operator.autoscaling.scrape import KV_USAGE_METRIC, LATENCY_METRIC, WAITING_METRIC
from disagg.operator.autoscaling.spec import AutoscalingSpec


def selector(namespace: str, deployment: str, role: str) -> str:
    pods = f"{deployment}-router-.+" if role == "router" else f"{deployment}-{role}-[0-9]+"
    return f'namespace="{namespace}",pod=~"{pods}",role="{role}"'


def latency_query(metric: str, q: float, sel: str, window_seconds: float) -> str:
    return f"histogram_quantile({q:g}, sum by (le) (rate({metric}_bucket{{{sel}}}[{int(window_seconds)}s])))"


def count_query(metric: str, sel: str, window_seconds: float) -> str:
    return f"sum(increase({metric}_count{{{sel}}}[{int(window_seconds)}s]))"


def queries(spec: AutoscalingSpec, namespace: str, deployment: str, window_seconds: float) -> dict[str, str]:
    """The PromQL the reader sends, by purpose (router latency first, the role's own second)."""
    metric = LATENCY_METRIC[spec.role]
    router, own = selector(namespace, deployment, "router"), selector(namespace, deployment, spec.role)
    out = {
        "latency_router": latency_query(metric, spec.quantile, router, window_seconds),
        "count_router": count_query(metric, router, window_seconds),
        "latency_own": latency_query(metric, spec.quantile, own, window_seconds),
        "count_own": count_query(metric, own, window_seconds),
        # Freshness: when the role's gauges were last scraped.
        "freshness": f"max(timestamp({WAITING_METRIC}{{{own}}}))",
    }
    if spec.role == "prefill":
        out["queue"] = f"sum({WAITING_METRIC}{{{own}}})"
    else:
        out["kv"] = f"avg({KV_USAGE_METRIC}{{{own}}})"
    return out


async def instant(session: aiohttp.ClientSession, base_url: str, query: str, timeout: float) -> float | None:
    """One instant query reduced to a scalar; None for an empty result."""
    url = base_url.rstrip("/") + "/api/v1/query"
    async with session.get(
        url, params={"query": query}, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as resp:
        body = await resp.json(content_type=None)
        if resp.status != 200 or body.get("status") != "success":
            raise RuntimeError(f"Prometheus HTTP {resp.status}: {body.get('error', body)}")
    result = body["data"]["result"]
    if body["data"].get("resultType") == "scalar":
        return float(result[1])
    if not result:
        return None
    return float(result[0]["value"][1])


async def observe(
    session: aiohttp.ClientSession,
    spec: AutoscalingSpec,
    namespace: str,
    deployment: str,
    now: float,
    window_seconds: float = 60.0,
    timeout: float = 5.0,
) -> Observation:
    base = spec.metrics_url
    qs = queries(spec, namespace, deployment, window_seconds)
    try:
        values = {key: await instant(session, base, q, timeout) for key, q in qs.items()}
    except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError, KeyError) as e:
        return Observation(now, source=base, error=f"Prometheus at {base}: {type(e).__name__}: {e}")
    if values["count_router"] is not None:
        latency, count, source = values["latency_router"], values["count_router"], "router"
    elif values["count_own"] is not None:
        latency, count, source = values["latency_own"], values["count_own"], spec.role
    else:
        return Observation(now, source=base, error=f"Prometheus has no {LATENCY_METRIC[spec.role]} series")
    if latency is not None and math.isnan(latency):
        latency = None  # series exist, nothing observed in the window: idle
    fresh = values["freshness"]
    return Observation(
        observed_at=fresh if fresh is not None else now,
        latency_seconds=latency,
        samples=count or 0.0,
        queue_waiting=values.get("queue"),
        kv_usage=values.get("kv"),
        source=f"Prometheus {base} ({source} series)",
    )
