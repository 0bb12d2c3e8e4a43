"""Both metrics readers over real HTTP on loopback.

The scraper reads pods' `/metrics` served by prometheus-client's own exposition. The PromQL
reader talks to an HTTP server that answers the Prometheus query API (no Prometheus binary
here); the test checks the queries it sends and how it reads vectors, NaN and empty results.
"""

from __future__ import annotations

import math

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from disagg.operator.autoscaling import prometheus
from disagg.operator.autoscaling.scrape import PodTarget, PoolScraper, pod_target
from disagg.operator.autoscaling.spec import parse_autoscaling

from .router_metrics import router_pod

PREFILL = parse_autoscaling("prefill", {"maxReplicas": 4, "target": {"ttftMilliseconds": 500}})
DECODE = parse_autoscaling("decode", {"maxReplicas": 4, "target": {"itlMilliseconds": 50}})


class FakePod:
    """A process's metrics as prometheus-client would serve them."""

    def __init__(self, role: str):
        self.registry = CollectorRegistry()
        lab = ("role", "model")
        self.role = role
        self.ttft = Histogram("disagg_time_to_first_token_seconds", "t", lab, registry=self.registry)
        self.itl = Histogram("disagg_inter_token_latency_seconds", "i", lab, registry=self.registry)
        self.waiting = Gauge("disagg_num_requests_waiting", "w", lab, registry=self.registry)
        self.kv = Gauge("disagg_kv_cache_usage_ratio", "k", lab, registry=self.registry)

    def labels(self, metric):
        return metric.labels(role=self.role, model="tiny")

    async def handle(self, request):
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")


@pytest.fixture
async def pods():
    made, runners = {}, []

    async def serve(name, role):
        pod = FakePod(role)
        app = web.Application()
        app.router.add_get("/metrics", pod.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        runners.append(runner)
        made[name] = (pod, PodTarget(name, role, f"http://127.0.0.1:{port}/metrics"))
        return made[name]

    yield serve
    for r in runners:
        await r.cleanup()


async def test_scraper_windows_sums_pods_and_prefers_the_router(pods):
    p0, t0 = await pods("x-prefill-0", "prefill")
    p1, t1 = await pods("x-prefill-1", "prefill")
    dead = PodTarget("x-prefill-2", "prefill", "http://127.0.0.1:9/metrics")
    scraper = PoolScraper(window_seconds=60)
    async with aiohttp.ClientSession() as s:
        for _ in range(500):  # history before the window: fast
            p0.labels(p0.ttft).observe(0.01)
        await scraper.scrape([t0, t1, dead], 0.0, s)
        warming = scraper.observe(PREFILL, 0.0)
        assert warming.error == "warming up: a window needs two scrapes" and warming.warming_up
        for _ in range(10):  # in the window: slow on pod 0, slower on pod 1
            p0.labels(p0.ttft).observe(0.9)
            p1.labels(p1.ttft).observe(3.0)
        p0.labels(p0.waiting).set(5)
        p1.labels(p1.waiting).set(4)
        await scraper.scrape([t0, t1, dead], 30.0, s)
        obs = scraper.observe(PREFILL, 30.0)
    assert obs.error is None and obs.samples == 20
    # p90 of the merged window: rank 18 of 20 is 8/10 into the (2.5, 5] bucket of the default layout.
    assert obs.latency_seconds == pytest.approx(2.5 + 2.5 * 0.8)
    assert obs.queue_waiting == 9
    assert "1 unreachable" in obs.source

    # Now a router exports TTFT: its view (what clients see) wins over the workers'.
    router, tr = await pods("x-router-abc", "router")
    async with aiohttp.ClientSession() as s:
        await scraper.scrape([t0, t1, tr], 45.0, s)
        for _ in range(4):
            router.labels(router.ttft).observe(0.2)
        await scraper.scrape([t0, t1, tr], 60.0, s)
    obs = scraper.observe(PREFILL, 60.0)
    assert obs.samples == 4 and obs.latency_seconds <= 0.25 and "router" in obs.source


async def test_scraper_decode_reads_itl_and_kv_use(pods):
    d0, t0 = await pods("x-decode-0", "decode")
    d1, t1 = await pods("x-decode-1", "decode")
    scraper = PoolScraper(window_seconds=60)
    async with aiohttp.ClientSession() as s:
        await scraper.scrape([t0, t1], 0.0, s)
        for _ in range(100):
            d0.labels(d0.itl).observe(0.02)
        d0.labels(d0.kv).set(0.6)
        d1.labels(d1.kv).set(0.8)
        await scraper.scrape([t0, t1], 15.0, s)
    obs = scraper.observe(DECODE, 15.0)
    assert obs.kv_usage == pytest.approx(0.7) and obs.samples == 100 and obs.latency_seconds <= 0.025


async def test_scraper_with_nobody_answering_says_so():
    scraper = PoolScraper()
    async with aiohttp.ClientSession() as s:
        await scraper.scrape([PodTarget("x-prefill-0", "prefill", "http://127.0.0.1:9/metrics")], 0.0, s)
    obs = scraper.observe(PREFILL, 0.0)
    assert obs.error.startswith("no prefill or router pod answered (x-prefill-0: ")
    empty = PoolScraper().observe(PREFILL, 0.0)
    assert empty.error == "no prefill or router pod answered (none running)"


def test_pod_target_from_a_pod_manifest():
    pod = {
        "metadata": {
            "name": "x-decode-1",
            "labels": {"disagg.dev/role": "decode"},
            "annotations": {"prometheus.io/port": "9200"},
        },
        "status": {
            "podIP": "10.0.0.7",
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    assert pod_target(pod) == PodTarget("x-decode-1", "decode", "http://10.0.0.7:9200/metrics")
    pod["status"]["conditions"][0]["status"] = "False"
    assert pod_target(pod) is None


def test_the_router_pod_the_operator_builds_is_scraped_on_its_api_port():
    """The router's series (what clients see) are read from the pod the builder makes, on the port
    `spec.router.service.port` names, not a fixed one."""
    pod = router_pod(9321)
    pod["status"]["podIP"] = "10.0.0.8"
    assert pod_target(pod) == PodTarget("tiny-router-7d9f-x2x", "router", "http://10.0.0.8:9321/metrics")


@pytest.fixture
async def prometheus_api():
    """An HTTP server answering /api/v1/query from a table of query -> result."""
    state = {"answers": {}, "seen": []}

    async def query(request):
        q = request.query["query"]
        state["seen"].append(q)
        for needle, value in state["answers"].items():
            if needle in q:
                result = [] if value is None else [{"metric": {}, "value": [1.0, str(value)]}]
                return web.json_response(
                    {"status": "success", "data": {"resultType": "vector", "result": result}}
                )
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": []}})

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    yield state
    await runner.cleanup()


async def test_promql_reader(prometheus_api):
    spec = parse_autoscaling(
        "prefill",
        {"maxReplicas": 4, "target": {"ttftMilliseconds": 500}, "metricsUrl": prometheus_api["url"]},
    )
    prometheus_api["answers"] = {
        'histogram_quantile(0.9, sum by (le) (rate(disagg_time_to_first_token_seconds_bucket{namespace="ns",'
        'pod=~"x-router-.+",role="router"}[60s])))': 0.8,
        'increase(disagg_time_to_first_token_seconds_count{namespace="ns",pod=~"x-router-.+"': 42,
        "max(timestamp(": 995.0,
        'sum(disagg_num_requests_waiting{namespace="ns",pod=~"x-prefill-[0-9]+",role="prefill"})': 3,
    }
    async with aiohttp.ClientSession() as s:
        obs = await prometheus.observe(s, spec, "ns", "x", now=1000.0)
    assert (obs.error, obs.latency_seconds, obs.samples, obs.queue_waiting, obs.observed_at) == (
        None,
        0.8,
        42,
        3,
        995.0,
    )

    prometheus_api["answers"] = {"_count": 0, "histogram_quantile": float("nan"), "max(timestamp(": 999.0}
    async with aiohttp.ClientSession() as s:
        idle = await prometheus.observe(s, spec, "ns", "x", now=1000.0)
    assert idle.error is None and idle.latency_seconds is None and idle.samples == 0

    prometheus_api["answers"] = {}
    async with aiohttp.ClientSession() as s:
        missing = await prometheus.observe(s, spec, "ns", "x", now=1000.0)
    assert missing.error == "Prometheus has no disagg_time_to_first_token_seconds series"

    down = parse_autoscaling(
        "prefill", {"maxReplicas": 4, "target": {"ttftMilliseconds": 500}, "metricsUrl": "http://127.0.0.1:9"}
    )
    async with aiohttp.ClientSession() as s:
        unreachable = await prometheus.observe(s, down, "ns", "x", now=1000.0)
    assert unreachable.error.startswith("Prometheus at http://127.0.0.1:9: ")
    assert not math.isnan(1000.0 - unreachable.observed_at)
