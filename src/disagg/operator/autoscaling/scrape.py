"""The metrics reader without Prometheus: scrape the pods' `/metrics` and window it ourselves.

Each tick scrapes the router pods and the role's worker pods. Latency comes from the
router's series (`role="router"`: what clients see) when the router exports it, else from the
role's own workers; it is the percentile of the bucket increase over the window, per pod,
summed over pods. Queue depth (prefill) and KV-cache use (decode) are the current gauges.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

import aiohttp

from disagg.operator import constants as c
from disagg.operator.autoscaling.control import Observation
from disagg.operator.autoscaling.metrics import Exposition, Histogram, merge, parse_exposition, quantile
from disagg.operator.autoscaling.spec import AutoscalingSpec

LATENCY_METRIC = {
    "prefill": "disagg_time_to_first_token_seconds",
    "decode": "disagg_inter_token_latency_seconds",
}
WAITING_METRIC = "disagg_num_requests_waiting"
KV_USAGE_METRIC = "disagg_kv_cache_usage_ratio"
# The container port that serves `/metrics` in each kind of pod the operator builds (the router
# serves it on its API port, `spec.router.service.port`); a `prometheus.io/port` annotation overrides it.
METRICS_PORT_NAME = {"prefill": "metrics", "decode": "metrics", "router": "http"}


@dataclass(frozen=True)
class PodTarget:
    name: str
    role: str
    url: str


def pod_target(pod: dict) -> PodTarget | None:
    """Where to scrape a pod, or None when it is not a running, ready disagg pod."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    role = (meta.get("labels") or {}).get(c.LABEL_ROLE)
    ip = status.get("podIP")
    if role not in METRICS_PORT_NAME or not ip or status.get("phase", "Running") != "Running":
        return None
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    if conditions.get("Ready", "True") != "True":
        return None
    annotations = meta.get("annotations") or {}
    port = annotations.get("prometheus.io/port") or _named_port(pod, METRICS_PORT_NAME[role])
    if port is None:
        return None
    path = annotations.get("prometheus.io/path") or "/metrics"
    host = f"[{ip}]" if ":" in ip else ip
    return PodTarget(meta.get("name", ip), role, f"http://{host}:{port}{path}")


def _named_port(pod: dict, name: str) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == name:
                return port.get("containerPort")
    return None


async def fetch(session: aiohttp.ClientSession, target: PodTarget, timeout: float) -> Exposition:
    async with session.get(target.url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        return parse_exposition(await resp.text())


class PoolScraper:
    """Scrape history of one InferenceDeployment's pods, enough to difference over a window."""

    def __init__(self, window_seconds: float = 60.0, timeout_seconds: float = 5.0):
        self.window = window_seconds
        self.timeout = timeout_seconds
        self.history: dict[str, deque[tuple[float, Exposition]]] = {}
        self.errors: dict[str, str] = {}
        self.roles: dict[str, str] = {}  # pod name -> role, as of the last scrape

    async def scrape(self, targets: list[PodTarget], now: float, session: aiohttp.ClientSession) -> None:
        pages = await asyncio.gather(
            *(fetch(session, t, self.timeout) for t in targets), return_exceptions=True
        )
        self.record(targets, now, pages)

    def record(self, targets: list[PodTarget], now: float, pages: list) -> None:
        """Keep what each pod answered (an Exposition) or why it did not (an exception)."""
        names = {t.name for t in targets}
        for gone in set(self.history) - names:
            del self.history[gone]
        self.errors = {}
        self.roles = {t.name: t.role for t in targets}
        for target, page in zip(targets, pages, strict=True):
            if isinstance(page, BaseException):
                self.errors[target.name] = f"{type(page).__name__}: {page}".rstrip(": ")
                continue
            snaps = self.history.setdefault(target.name, deque())
            snaps.append((now, page))
            # Keep the newest snapshot that is at least a window old as the baseline.
            while len(snaps) > 2 and snaps[1][0] <= now - self.window:
                snaps.popleft()

    def _delta(self, pod: str, metric: str, series_role: str) -> Histogram | None:
        snaps = self.history.get(pod)
        if not snaps or len(snaps) < 2:
            return None
        (_, old), (_, new) = snaps[0], snaps[-1]
        newer = new.histogram(metric, role=series_role)
        if newer is None:
            return None
        older = old.histogram(metric, role=series_role)
        return newer if older is None else newer.minus(older)

    def _latest(self, pod: str) -> Exposition | None:
        snaps = self.history.get(pod)
        return snaps[-1][1] if snaps else None

    def observe(self, spec: AutoscalingSpec, now: float) -> Observation:
        """The role's windowed percentile and gauges from what was scraped so far."""
        role = spec.role
        metric = LATENCY_METRIC[role]
        pods = {name: r for name, r in self.roles.items() if r in (role, "router")}
        answered = [p for p in pods if p in self.history and p not in self.errors]
        if not answered:
            detail = "; ".join(f"{p}: {e}" for p, e in sorted(self.errors.items()) if p in pods)
            return Observation(
                now,
                source="scrape",
                error=f"no {role} or router pod answered" + (f" ({detail})" if detail else " (none running)"),
            )
        # Latency: the router's view when the router exports it, else the role's own workers.
        router_pods = [
            p for p in answered if pods[p] == "router" and self._latest(p).histogram(metric, role="router")
        ]
        if router_pods:
            source_pods, series_role = router_pods, "router"
        else:
            source_pods, series_role = [p for p in answered if pods[p] == role], role
        if not source_pods:
            return Observation(now, source="scrape", error=f"no pod exports {metric}")
        deltas = [self._delta(p, metric, series_role) for p in source_pods]
        if all(d is None for d in deltas):
            return Observation(
                now, source="scrape", error="warming up: a window needs two scrapes", warming_up=True
            )
        window = merge(d for d in deltas if d is not None)
        workers = [self._latest(p) for p in answered if pods[p] == role]
        queue = kv = None
        if role == "prefill":
            queue = sum(v for page in workers for v in page.gauge_values(WAITING_METRIC, role=role))
        else:
            usage = [v for page in workers for v in page.gauge_values(KV_USAGE_METRIC, role=role)]
            kv = sum(usage) / len(usage) if usage else None
        missing = len(self.errors.keys() & pods.keys())
        source = f"scrape of {len(answered)}/{len(pods)} pods ({series_role} {metric})"
        if missing:
            source += f", {missing} unreachable"
        return Observation(
            observed_at=now,
            latency_seconds=quantile(spec.quantile, window),
            samples=window.count if window else 0.0,
            queue_waiting=queue,
            kv_usage=kv,
            source=source,
        )
