"""`GET /v1/models` and `GET /v1/models/{id}` (the SDKs' `models.list` and `models.retrieve`):
the one model this router serves."""

from __future__ import annotations

import time

from aiohttp import web

from disagg.worker.router.client_checks import check_api_key, unknown_model
from disagg.worker.router.policy import served_quantization
from disagg.worker.router.workers import WorkerPool


class ModelEndpoints:
    def __init__(self, model_name: str, api_keys: frozenset[str], pool: WorkerPool):
        self.model_name = model_name
        self.api_keys = api_keys
        self.pool = pool
        self.created = int(time.time())  # the card's `created`: when this router started serving it

    def card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "disagg",
            "quantization": served_quantization(self.pool.views()),
        }

    async def models(self, request: web.Request) -> web.Response:
        check_api_key(request, self.api_keys)
        return web.json_response({"object": "list", "data": [self.card()]})

    async def model(self, request: web.Request) -> web.Response:
        check_api_key(request, self.api_keys)
        model_id = request.match_info["model_id"].rstrip("/")
        if model_id != self.model_name:
            raise unknown_model(model_id)
        return web.json_response(self.card())
