"""A router's `/metrics` served over real HTTP for the autoscaler tests, and the Pod that points at it."""

from __future__ import annotations

import contextlib
import pathlib

import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest


class RouterMetrics:
    """The router's `/metrics`: every scrape adds a batch of requests at the current latency."""

    def __init__(self):
        self.registry = CollectorRegistry()
        lab = ("role", "model")
        self.ttft = Histogram("disagg_time_to_first_token_seconds", "t", lab, registry=self.registry)
        self.itl = Histogram("disagg_inter_token_latency_seconds", "i", lab, registry=self.registry)
        self.ttft_seconds = 1.2  # target 0.5 s: far over
        self.port = 0

    async def handle(self, request):
        for _ in range(10):
            self.ttft.labels(role="router", model="tiny").observe(self.ttft_seconds)
            self.itl.labels(role="router", model="tiny").observe(0.01)  # target 50 ms: well within
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")


@contextlib.asynccontextmanager
async def serving_router_metrics():
    metrics = RouterMetrics()
    app = web.Application()
    app.router.add_get("/metrics", metrics.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    metrics.port = site._server.sockets[0].getsockname()[1]
    try:
        yield metrics
    finally:
        await runner.cleanup()


def pod_from(workload: dict, name: str, ip: str = "127.0.0.1") -> dict:
    """A running, ready Pod as its controller would make it from `workload`'s template."""
    template = workload["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": workload["metadata"]["namespace"],
            "labels": dict(template["metadata"]["labels"]),
            "annotations": dict(template["metadata"].get("annotations") or {}),
        },
        "spec": template["spec"],
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def router_pod(port: int, deployment: str = "tiny") -> dict:
    """The router Pod of the cpu-tiny example, built by the operator's own builder, serving on `port`."""
    from disagg.operator import spec as specs
    from disagg.operator.builders import router

    root = pathlib.Path(__file__).resolve().parents[3]
    body = yaml.safe_load((root / "examples" / "cpu-tiny.yaml").read_text())
    body["metadata"].update(name=deployment, namespace="default", uid="uid-1")
    body["spec"]["router"]["service"] = {"port": port}
    return pod_from(router.deployment(specs.parse(body)), f"{deployment}-router-7d9f-x2x")
