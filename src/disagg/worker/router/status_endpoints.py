"""What the router answers about itself: readiness (`/health`, `/ping`), `/version`,
`/openapi.json`, Prometheus `/metrics`, and `/internal/workers` for holders of the deployment's
internal credential."""

from __future__ import annotations

import importlib.metadata

from aiohttp import web

from disagg.worker.router import readiness
from disagg.worker.router.openapi import openapi_spec
from disagg.worker.router.policy import WorkerView
from disagg.worker.router.workers import WorkerPool
from disagg.worker.serving.auth import REFUSED, InternalAuth
from disagg.worker.serving.metrics import CONTENT_TYPE, ServingMetrics

try:
    VERSION = importlib.metadata.version("disagg")
except importlib.metadata.PackageNotFoundError:  # a source tree without the distribution installed
    VERSION = "unknown"


def _load_fields(v: WorkerView) -> dict[str, int | float]:
    """A worker's load at the last poll, as routing sees it."""
    return {
        "running": v.running, "waiting": v.waiting, "free_blocks": v.free_blocks,
        "total_blocks": v.total_blocks, "queued_prefill_tokens": v.queued_prefill_tokens,
        "prefill_tokens_per_s": v.prefill_tokens_per_s, "decode_step_seconds": v.decode_step_seconds,
    }  # fmt: skip


class StatusEndpoints:
    def __init__(
        self, model_name: str, pool: WorkerPool, metrics: ServingMetrics, internal_auth: InternalAuth
    ):
        self.model_name = model_name
        self.pool = pool
        self.metrics = metrics
        self.internal_auth = internal_auth

    async def health(self, _request: web.Request) -> web.Response:
        """Readiness for clients and probes: counts only, no worker ids or internal addresses."""
        views = self.pool.views()
        decode = sum(1 for v in views if v.role in ("decode", "both"))
        prefill = sum(1 for v in views if v.role == "prefill")
        state = readiness.Readiness(decode, prefill, self.pool.registry_problem, self.pool.uses_registry)
        return web.json_response(state.body(), status=200 if state.ready else 503)

    async def version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def openapi(self, _request: web.Request) -> web.Response:
        return web.json_response(openapi_spec(self.model_name))

    async def metrics_page(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def internal_workers(self, request: web.Request) -> web.Response:
        """Every known worker with its id and address, for operators and tools holding the
        deployment's internal credential."""
        if not self.internal_auth.check(request.headers.get("Authorization")):
            REFUSED.labels("internal_workers").inc()
            return web.json_response({"error": "missing or wrong internal credential"}, status=401)
        body = {
            "workers": [
                {
                    "id": v.worker_id if v else None,
                    "address": addr,
                    "role": v.role if v else None,
                    "ready": ready,
                    "load": _load_fields(v) if v else None,
                }
                for v, ready, addr in self.pool.all_views()
            ],
            "registry": self.pool.registry_ok,
        }
        return web.json_response(body)
