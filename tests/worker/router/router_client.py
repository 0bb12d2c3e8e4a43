"""The router's HTTP app in-process, over an empty worker pool: for tests of the HTTP layer."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from disagg.worker.router.app import Router, RouterConfig
from disagg.worker.router.workers import WorkerPool


async def router_client(tokenizer, **config) -> TestClient:
    """A started test client of a router for the tiny model (64-token context) with `config`."""
    router = Router(
        RouterConfig(model_name="tiny", max_model_len=64, **config), tokenizer, WorkerPool(None, [])
    )
    client = TestClient(TestServer(router.app()))
    await client.start_server()
    return client
